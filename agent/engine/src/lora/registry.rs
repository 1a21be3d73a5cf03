//! The adapter registry: which adapters are loaded (by name), their weights in host memory (LRU,
//! `max_cpu_loras`), and which of them occupy the backend's `max_loras` slots in a step.
//!
//! Owned by the engine thread; never parses files (the caller does that off the thread and hands
//! over the parsed [`LoraAdapter`]). Requests pin the *version* of an adapter they started with
//! ([`AdapterId`]), so replacing or unloading a name never changes a running request's output: the
//! old version stays until its last request releases it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use serde::Serialize;

use super::adapter::LoraAdapter;
use crate::{EngineError, Result};

/// Limits of the LoRA machinery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoraConfig {
    /// Adapters that can take part in one step (backend slots).
    pub max_loras: usize,
    /// Largest accepted rank; slots are padded to it.
    pub max_lora_rank: usize,
    /// Adapters kept in host memory; beyond it the least recently used idle ones are dropped and
    /// reloaded from their source on their next request.
    pub max_cpu_loras: usize,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            max_loras: 4,
            max_lora_rank: 64,
            max_cpu_loras: 16,
        }
    }
}

/// One loaded version of a named adapter; a replace under the same name gets a new id.
pub type AdapterId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterState {
    /// Weights in host memory, occupying a backend slot.
    Active,
    /// Weights in host memory, no slot.
    Loaded,
    /// Weights dropped from host memory (LRU); reloaded from `source` on demand.
    Evicted,
    /// Unloaded or replaced: new requests cannot use it; waits for its in-flight requests.
    Unloading,
    /// Evicted, and re-reading `source` failed (files deleted or damaged since the load): requests
    /// naming it are refused until an admin load of the name succeeds. It does not heal by itself.
    Failed,
}

/// What `GET /v1/adapters` reports about one adapter version.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdapterInfo {
    pub name: String,
    pub id: AdapterId,
    pub source: PathBuf,
    pub rank: usize,
    pub state: AdapterState,
    pub slot: Option<u32>,
    pub loaded_at: SystemTime,
    pub last_used: Option<SystemTime>,
    /// Requests that finished (completed, aborted or failed) on this version.
    pub requests_served: u64,
    /// Requests holding this version now (waiting or running).
    pub in_flight: usize,
    pub size_bytes: usize,
    /// `sha256:` digest of the files this version's weights were read from (see
    /// [`super::adapter::content_digest`]); empty for adapters built in memory.
    pub digest: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LoadOutcome {
    /// A new name.
    Loaded,
    /// The name was loaded from the same source already: nothing changed.
    AlreadyLoaded,
    /// The name pointed at another source; new requests get the new version, running ones finish
    /// on the old.
    Replaced,
}

#[derive(Debug)]
struct Version {
    name: String,
    source: PathBuf,
    rank: usize,
    size_bytes: usize,
    digest: String,
    weights: Option<Arc<LoraAdapter>>,
    loaded_at: SystemTime,
    last_used: Option<SystemTime>,
    requests_served: u64,
    in_flight: usize,
    retiring: bool,
    /// Host-LRU clock value of the last use.
    host_tick: u64,
    slot: Option<usize>,
    /// Re-reading the evicted weights failed; cleared only by an admin load.
    failed: bool,
}

/// How much the adapter cache holds, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterCacheStats {
    /// Bytes of adapter weights in host memory.
    pub host_bytes: u64,
    /// Adapter versions whose weights are in host memory (`max_cpu_loras` bounds the idle ones).
    pub host_adapters: usize,
    /// Backend slots holding an adapter, of `slots`.
    pub slots_used: usize,
    pub slots: usize,
}

/// Who occupies a backend slot, and the step it was last used in.
#[derive(Debug, Clone, Copy)]
struct SlotUse {
    id: AdapterId,
    last_step: u64,
}

/// The slots of one step: which slot each adapter uses, and what the backend must (re)load first.
#[derive(Debug, Default)]
pub struct SlotAssignment {
    pub slot_of: HashMap<AdapterId, u32>,
    /// `(slot, weights)` to write into the backend before the step runs.
    pub loads: Vec<(u32, Arc<LoraAdapter>)>,
}

#[derive(Debug)]
pub struct LoraRegistry {
    config: LoraConfig,
    names: HashMap<String, AdapterId>,
    versions: HashMap<AdapterId, Version>,
    slots: Vec<Option<SlotUse>>,
    next_id: AdapterId,
    step: u64,
    tick: u64,
}

impl LoraRegistry {
    pub fn new(config: LoraConfig) -> LoraRegistry {
        LoraRegistry {
            config,
            names: HashMap::new(),
            versions: HashMap::new(),
            slots: vec![None; config.max_loras],
            next_id: 1,
            step: 0,
            tick: 0,
        }
    }

    pub fn config(&self) -> &LoraConfig {
        &self.config
    }

    /// The current version of `name`, if loaded (not unloading).
    pub fn lookup(&self, name: &str) -> Option<AdapterId> {
        self.names.get(name).copied()
    }

    /// Registers parsed weights under `name`. Same name, source and content digest as the loaded
    /// version: no-op (weights refilled if they had been evicted). Another source, or the same
    /// folder with other content (files replaced in place): the new version takes the name at once
    /// and the old one retires when its last request finishes.
    pub fn install(
        &mut self,
        name: &str,
        source: &Path,
        adapter: Arc<LoraAdapter>,
    ) -> (LoadOutcome, AdapterInfo) {
        self.tick += 1;
        let outcome = match self.names.get(name).copied() {
            Some(id) if self.versions.get(&id).is_some_and(|v| v.source == source && v.digest == adapter.digest) => {
                let mut outcome = LoadOutcome::AlreadyLoaded;
                if let Some(v) = self.versions.get_mut(&id) {
                    if v.weights.is_none() {
                        v.weights = Some(adapter);
                    }
                    if v.failed {
                        // The files are readable again (the caller just parsed them): servable.
                        v.failed = false;
                        outcome = LoadOutcome::Loaded;
                    }
                    v.host_tick = self.tick;
                }
                self.enforce_host_limit(id);
                return (outcome, self.info_of(id));
            }
            Some(old) => {
                self.retire(old);
                LoadOutcome::Replaced
            }
            None => LoadOutcome::Loaded,
        };
        let id = self.next_id;
        self.next_id += 1;
        self.versions.insert(
            id,
            Version {
                name: name.to_string(),
                source: source.to_path_buf(),
                rank: adapter.rank,
                size_bytes: adapter.size_bytes(),
                digest: adapter.digest.clone(),
                weights: Some(adapter),
                loaded_at: SystemTime::now(),
                last_used: None,
                requests_served: 0,
                in_flight: 0,
                retiring: false,
                host_tick: self.tick,
                slot: None,
                failed: false,
            },
        );
        self.names.insert(name.to_string(), id);
        self.enforce_host_limit(id);
        (outcome, self.info_of(id))
    }

    /// Removes `name`: new requests get [`EngineError::UnknownAdapter`]; running ones finish first.
    pub fn unload(&mut self, name: &str) -> Result<AdapterInfo> {
        let id = self
            .names
            .get(name)
            .copied()
            .ok_or_else(|| EngineError::UnknownAdapter(name.to_string()))?;
        let mut info = self.info_of(id);
        info.state = AdapterState::Unloading;
        self.retire(id);
        Ok(info)
    }

    /// Pins the current version of `name` for a new request. A failed adapter is refused with
    /// [`EngineError::AdapterUnavailable`].
    pub fn acquire(&mut self, name: &str) -> Result<AdapterId> {
        let id = self
            .lookup(name)
            .ok_or_else(|| EngineError::UnknownAdapter(name.to_string()))?;
        if self.versions.get(&id).is_some_and(|v| v.failed) {
            return Err(EngineError::AdapterUnavailable(name.to_string()));
        }
        self.tick += 1;
        if let Some(v) = self.versions.get_mut(&id) {
            v.in_flight += 1;
            v.last_used = Some(SystemTime::now());
            v.host_tick = self.tick;
        }
        Ok(id)
    }

    /// A request pinned to `id` finished (any way). Drops a retiring version with no requests left.
    pub fn release(&mut self, id: AdapterId) {
        let Some(v) = self.versions.get_mut(&id) else {
            return;
        };
        v.in_flight = v.in_flight.saturating_sub(1);
        v.requests_served += 1;
        if v.retiring && v.in_flight == 0 {
            self.remove_version(id);
        }
    }

    /// The source to re-read when `id`'s weights are not in host memory (None: resident or gone).
    pub fn reload_source(&self, id: AdapterId) -> Option<PathBuf> {
        self.versions
            .get(&id)
            .filter(|v| v.weights.is_none())
            .map(|v| v.source.clone())
    }

    /// Puts re-read weights back for `id` (after [`Self::reload_source`]).
    pub fn restore(&mut self, id: AdapterId, adapter: Arc<LoraAdapter>) {
        self.tick += 1;
        if let Some(v) = self.versions.get_mut(&id) {
            if v.weights.is_none() {
                // Re-read from the folder: report what is served now, even if the files changed.
                v.digest = adapter.digest.clone();
            }
            v.weights.get_or_insert(adapter);
            v.host_tick = self.tick;
        }
        self.enforce_host_limit(id);
    }

    /// Re-reading `id`'s evicted weights failed: new requests for it are refused until an admin
    /// load. Returns the name when `id` is still the version that name serves (not a retiring one).
    pub fn mark_failed(&mut self, id: AdapterId) -> Option<String> {
        let v = self.versions.get_mut(&id)?;
        if v.weights.is_some() {
            // Restored meanwhile (an admin load raced with the reload): nothing failed.
            return None;
        }
        v.failed = true;
        let name = v.name.clone();
        (self.names.get(&name) == Some(&id)).then_some(name)
    }

    /// What the adapter cache holds now.
    pub fn cache_stats(&self) -> AdapterCacheStats {
        let resident = self.versions.values().filter(|v| v.weights.is_some());
        AdapterCacheStats {
            host_bytes: resident.clone().map(|v| v.size_bytes as u64).sum(),
            host_adapters: resident.count(),
            slots_used: self.slots.iter().filter(|s| s.is_some()).count(),
            slots: self.slots.len(),
        }
    }

    /// The adapter version `id` is still known (not fully retired).
    pub fn contains(&self, id: AdapterId) -> bool {
        self.versions.contains_key(&id)
    }

    /// Gives every adapter of this step a slot. Adapters already in a slot keep it; the others take
    /// an empty slot or evict the least recently used adapter that this step does not need
    /// (idle adapters first). Fails only when the step needs more adapters than there are slots, or
    /// an adapter's weights are not in host memory — both prevented by the engine.
    pub fn assign_slots(&mut self, step_adapters: &[AdapterId]) -> Result<SlotAssignment> {
        self.step += 1;
        let mut needed: Vec<AdapterId> = step_adapters.to_vec();
        needed.sort_unstable();
        needed.dedup();
        if needed.len() > self.slots.len() {
            return Err(EngineError::Backend(format!(
                "a step needs {} adapters but there are {} LoRA slots",
                needed.len(),
                self.slots.len()
            )));
        }
        let mut out = SlotAssignment::default();
        let mut missing = Vec::new();
        for &id in &needed {
            let v = self
                .versions
                .get(&id)
                .ok_or_else(|| EngineError::Backend(format!("adapter version {id} is gone")))?;
            match v.slot {
                Some(s) => {
                    self.slots[s] = Some(SlotUse {
                        id,
                        last_step: self.step,
                    });
                    out.slot_of.insert(id, s as u32);
                }
                None => missing.push(id),
            }
        }
        for id in missing {
            let weights = self
                .versions
                .get(&id)
                .and_then(|v| v.weights.clone())
                .ok_or_else(|| {
                    EngineError::Backend(format!("adapter version {id} is not in host memory"))
                })?;
            let slot = self.pick_slot(&needed)?;
            if let Some(prev) = self.slots[slot].take() {
                if let Some(v) = self.versions.get_mut(&prev.id) {
                    v.slot = None;
                }
            }
            self.slots[slot] = Some(SlotUse {
                id,
                last_step: self.step,
            });
            if let Some(v) = self.versions.get_mut(&id) {
                v.slot = Some(slot);
            }
            out.slot_of.insert(id, slot as u32);
            out.loads.push((slot as u32, weights));
        }
        Ok(out)
    }

    fn pick_slot(&self, needed: &[AdapterId]) -> Result<usize> {
        if let Some(free) = self.slots.iter().position(Option::is_none) {
            return Ok(free);
        }
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| s.map(|s| (i, s)))
            .filter(|(_, s)| !needed.contains(&s.id))
            // Idle adapters (no request holds them) go before busy ones, then least recently used.
            .min_by_key(|(_, s)| {
                (
                    self.versions.get(&s.id).map_or(0, |v| v.in_flight) > 0,
                    s.last_step,
                )
            })
            .map(|(i, _)| i)
            .ok_or_else(|| EngineError::Backend("no LoRA slot can be freed for this step".into()))
    }

    /// Every loaded adapter, then versions still finishing requests after an unload or replace.
    pub fn list(&self) -> Vec<AdapterInfo> {
        let mut ids: Vec<AdapterId> = self.versions.keys().copied().collect();
        ids.sort_unstable();
        let mut infos: Vec<AdapterInfo> = ids.into_iter().map(|id| self.info_of(id)).collect();
        infos.sort_by(|a, b| {
            (a.state == AdapterState::Unloading, &a.name, a.id).cmp(&(
                b.state == AdapterState::Unloading,
                &b.name,
                b.id,
            ))
        });
        infos
    }

    pub fn info(&self, name: &str) -> Option<AdapterInfo> {
        self.lookup(name).map(|id| self.info_of(id))
    }

    /// Number of adapters whose weights are in host memory.
    pub fn resident_count(&self) -> usize {
        self.versions
            .values()
            .filter(|v| v.weights.is_some())
            .count()
    }

    fn info_of(&self, id: AdapterId) -> AdapterInfo {
        let Some(v) = self.versions.get(&id) else {
            // Only reached for ids taken from `names`/`versions` just before; keep it total anyway.
            return AdapterInfo {
                name: String::new(),
                id,
                source: PathBuf::new(),
                rank: 0,
                state: AdapterState::Unloading,
                slot: None,
                loaded_at: SystemTime::UNIX_EPOCH,
                last_used: None,
                requests_served: 0,
                in_flight: 0,
                size_bytes: 0,
                digest: String::new(),
            };
        };
        let state = if v.retiring {
            AdapterState::Unloading
        } else if v.failed {
            AdapterState::Failed
        } else if v.slot.is_some() {
            AdapterState::Active
        } else if v.weights.is_some() {
            AdapterState::Loaded
        } else {
            AdapterState::Evicted
        };
        AdapterInfo {
            name: v.name.clone(),
            id,
            source: v.source.clone(),
            rank: v.rank,
            state,
            slot: v.slot.map(|s| s as u32),
            loaded_at: v.loaded_at,
            last_used: v.last_used,
            requests_served: v.requests_served,
            in_flight: v.in_flight,
            size_bytes: v.size_bytes,
            digest: v.digest.clone(),
        }
    }

    fn retire(&mut self, id: AdapterId) {
        let Some(v) = self.versions.get_mut(&id) else {
            return;
        };
        if self.names.get(&v.name) == Some(&id) {
            self.names.remove(&v.name);
        }
        v.retiring = true;
        if v.in_flight == 0 {
            self.remove_version(id);
        }
    }

    fn remove_version(&mut self, id: AdapterId) {
        if let Some(v) = self.versions.remove(&id) {
            if let Some(s) = v.slot {
                self.slots[s] = None;
            }
        }
    }

    /// Drops the host weights of the least recently used idle adapters beyond `max_cpu_loras`.
    /// Adapters with requests in flight keep theirs (the limit is soft while they run), so a
    /// scheduled request never waits on disk.
    fn enforce_host_limit(&mut self, keep: AdapterId) {
        while self.resident_count() > self.config.max_cpu_loras.max(1) {
            let victim = self
                .versions
                .iter()
                .filter(|(&id, v)| id != keep && v.weights.is_some() && v.in_flight == 0)
                .min_by_key(|(_, v)| v.host_tick)
                .map(|(&id, _)| id);
            let Some(victim) = victim else { break };
            if let Some(v) = self.versions.get_mut(&victim) {
                v.weights = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lora::random::RandomAdapterSpec;
    use crate::lora::test_support::tiny_config;

    fn adapter(seed: u64) -> Arc<LoraAdapter> {
        Arc::new(LoraAdapter::random(
            &tiny_config(),
            &RandomAdapterSpec::new(2, seed),
        ))
    }

    fn registry(max_loras: usize, max_cpu_loras: usize) -> LoraRegistry {
        LoraRegistry::new(LoraConfig {
            max_loras,
            max_lora_rank: 8,
            max_cpu_loras,
        })
    }

    fn with_digest(seed: u64, digest: &str) -> Arc<LoraAdapter> {
        let mut a = (*adapter(seed)).clone();
        a.digest = digest.to_string();
        Arc::new(a)
    }

    #[test]
    fn the_same_folder_with_other_content_is_a_new_version() {
        let mut r = registry(2, 4);
        let (_, v1) = r.install("a", Path::new("/x/a"), with_digest(1, "sha256:11"));
        assert_eq!(v1.digest, "sha256:11");
        let (o, same) = r.install("a", Path::new("/x/a"), with_digest(1, "sha256:11"));
        assert_eq!((o, same.id), (LoadOutcome::AlreadyLoaded, v1.id));
        // Files replaced in place: same path, other bytes.
        let (o, v2) = r.install("a", Path::new("/x/a"), with_digest(2, "sha256:22"));
        assert_eq!(o, LoadOutcome::Replaced);
        assert_ne!(v2.id, v1.id);
        assert_eq!(v2.digest, "sha256:22");
        let listed: Vec<(String, String)> = r.list().into_iter().filter(|i| i.state != AdapterState::Unloading).map(|i| (i.name, i.digest)).collect();
        assert_eq!(listed, [("a".to_string(), "sha256:22".to_string())]);
    }

    #[test]
    fn load_is_idempotent_and_replace_keeps_running_requests_on_the_old_version() {
        let mut r = registry(2, 4);
        let (o, info) = r.install("a", Path::new("/x/a1"), adapter(1));
        assert_eq!(o, LoadOutcome::Loaded);
        let (o, again) = r.install("a", Path::new("/x/a1"), adapter(1));
        assert_eq!((o, again.id), (LoadOutcome::AlreadyLoaded, info.id));

        let old = r.acquire("a").unwrap();
        let (o, new_info) = r.install("a", Path::new("/x/a2"), adapter(2));
        assert_eq!(o, LoadOutcome::Replaced);
        assert_ne!(new_info.id, old);
        assert_eq!(
            r.acquire("a").unwrap(),
            new_info.id,
            "new requests get the new version"
        );
        assert!(
            r.contains(old),
            "old version stays while a request holds it"
        );
        assert_eq!(
            r.list()
                .iter()
                .filter(|i| i.state == AdapterState::Unloading)
                .count(),
            1
        );
        r.release(old);
        assert!(!r.contains(old));
        assert_eq!(r.list().len(), 1);
    }

    #[test]
    fn unload_hides_the_name_but_waits_for_in_flight_requests() {
        let mut r = registry(2, 4);
        r.install("a", Path::new("/a"), adapter(1));
        let id = r.acquire("a").unwrap();
        let slots = r.assign_slots(&[id]).unwrap();
        assert_eq!(slots.loads.len(), 1);
        r.unload("a").unwrap();
        assert!(matches!(r.acquire("a"), Err(EngineError::UnknownAdapter(n)) if n == "a"));
        assert!(matches!(r.unload("a"), Err(EngineError::UnknownAdapter(_))));
        // The running request still gets its slot.
        assert_eq!(
            r.assign_slots(&[id]).unwrap().slot_of[&id],
            slots.slot_of[&id]
        );
        r.release(id);
        assert!(r.list().is_empty());
        assert_eq!(r.info("a"), None);
    }

    #[test]
    fn slots_are_reused_and_evicted_lru_idle_first() {
        let mut r = registry(2, 8);
        for (n, s) in [("a", 1), ("b", 2), ("c", 3)] {
            r.install(n, Path::new(n), adapter(s));
        }
        let a = r.acquire("a").unwrap();
        let b = r.acquire("b").unwrap();
        let first = r.assign_slots(&[a, b]).unwrap();
        assert_eq!(first.loads.len(), 2);
        // Same adapters again: no reload.
        assert!(r.assign_slots(&[b, a]).unwrap().loads.is_empty());
        // b finishes; a is still running. c must evict b (idle), not a.
        r.release(b);
        let c = r.acquire("c").unwrap();
        let third = r.assign_slots(&[c]).unwrap();
        assert_eq!(third.loads.len(), 1);
        assert_eq!(third.slot_of[&c], first.slot_of[&b]);
        assert_eq!(r.info("b").unwrap().state, AdapterState::Loaded);
        assert_eq!(r.info("a").unwrap().state, AdapterState::Active);
        // More adapters than slots in one step is refused.
        let b2 = r.acquire("b").unwrap();
        assert!(r.assign_slots(&[a, b2, c]).is_err());
    }

    #[test]
    fn host_memory_is_lru_limited_and_reloadable() {
        let mut r = registry(1, 2);
        r.install("a", Path::new("/a"), adapter(1));
        r.install("b", Path::new("/b"), adapter(2));
        let held = r.acquire("a").unwrap();
        r.install("c", Path::new("/c"), adapter(3));
        // a is in flight, so the idle b is the one dropped.
        assert_eq!(r.resident_count(), 2);
        assert_eq!(r.info("b").unwrap().state, AdapterState::Evicted);
        let b = r.acquire("b").unwrap();
        assert_eq!(r.reload_source(b), Some(PathBuf::from("/b")));
        assert!(
            r.assign_slots(&[b]).is_err(),
            "weights must be restored before a step"
        );
        r.restore(b, adapter(2));
        assert_eq!(r.reload_source(b), None);
        r.release(held);
        assert!(r.assign_slots(&[b]).is_ok());
        let info = r.info("a").unwrap();
        assert_eq!((info.requests_served, info.in_flight), (1, 0));
    }

    #[test]
    fn a_failed_reload_refuses_the_adapter_until_it_is_loaded_again() {
        let mut r = registry(1, 1);
        r.install("a", Path::new("/a"), adapter(1));
        r.install("b", Path::new("/b"), adapter(2));
        assert_eq!(r.info("a").unwrap().state, AdapterState::Evicted);
        let stats = r.cache_stats();
        assert_eq!((stats.host_adapters, stats.slots_used, stats.slots), (1, 0, 1));
        assert_eq!(stats.host_bytes, adapter(2).size_bytes() as u64);

        let id = r.acquire("a").unwrap();
        assert_eq!(r.mark_failed(id), Some("a".to_string()));
        r.release(id);
        assert_eq!(r.info("a").unwrap().state, AdapterState::Failed);
        assert!(matches!(r.acquire("a"), Err(EngineError::AdapterUnavailable(n)) if n == "a"));
        // Other adapters are unaffected.
        assert!(r.acquire("b").is_ok());

        // An admin load of the same source clears it.
        let (outcome, info) = r.install("a", Path::new("/a"), adapter(1));
        assert_eq!((outcome, info.state), (LoadOutcome::Loaded, AdapterState::Loaded));
        assert!(r.acquire("a").is_ok());
        // A version restored meanwhile is not marked failed.
        assert_eq!(r.mark_failed(info.id), None);
    }
}
