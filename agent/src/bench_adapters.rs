//! Where `bench` and `throughput` get their LoRA adapters: `--lora N --lora-rank R` writes N random
//! PEFT adapters of rank R to a scratch folder; `--lora-dir DIR` takes the PEFT adapters already in a
//! folder (a team's own fine-tunes, their ranks and target modules as trained). Either way they are
//! loaded by name through the engine, the path a served adapter takes.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use peregrine_engine::bench::lora::write_random_adapters;
use peregrine_engine::lora::adapter::CONFIG_FILE;
use peregrine_engine::lora::AdapterConfig;
use serde::Serialize;

use crate::runtime::{EngineArgs, Runtime};

/// A PEFT adapter found in `--lora-dir`: its folder, the name it is loaded under (the folder's
/// own name) and its rank (read from `adapter_config.json`, so the engine can reserve it).
#[derive(Debug, Clone, PartialEq)]
pub struct FolderAdapter {
    pub name: String,
    pub path: PathBuf,
    pub rank: usize,
}

/// The adapters a benchmark runs its LoRA side on.
#[derive(Debug, Clone, PartialEq)]
pub enum AdapterSource {
    /// No LoRA side.
    None,
    /// `count` random adapters of `rank` on all seven projections.
    Random { count: usize, rank: usize },
    /// The adapters of a folder, in name order.
    Folder { dir: PathBuf, adapters: Vec<FolderAdapter> },
}

/// How a report names its adapters (`--json` and the printed line).
#[derive(Debug, Clone, Serialize)]
pub struct AdapterSummary {
    pub adapters: usize,
    /// The largest rank (every adapter's with random ones).
    pub rank: usize,
    /// Each adapter's rank, in load order.
    pub ranks: Vec<usize>,
    /// `random`, or the folder given to `--lora-dir`.
    pub source: String,
    /// Whether they came from `--lora-dir` (what `describe` says; a folder may be named "random").
    #[serde(skip)]
    from_folder: bool,
}

impl AdapterSource {
    /// From the flags. With `--lora-dir`, `lora` > 0 takes that many of the folder's adapters (the
    /// first in name order) and 0 takes them all; `rank` is then unused. Without it, `lora` random
    /// adapters of `rank` (none for 0).
    pub fn from_flags(lora: usize, rank: usize, dir: Option<&Path>) -> anyhow::Result<AdapterSource> {
        let Some(dir) = dir else {
            return Ok(if lora == 0 { AdapterSource::None } else { AdapterSource::Random { count: lora, rank } });
        };
        let mut adapters = scan_adapter_dir(dir)?;
        if lora > adapters.len() {
            anyhow::bail!("--lora {lora} asks for more adapters than --lora-dir {} holds ({})", dir.display(), adapters.len());
        }
        if lora > 0 {
            adapters.truncate(lora);
        }
        Ok(AdapterSource::Folder { dir: dir.to_path_buf(), adapters })
    }

    pub fn count(&self) -> usize {
        match self {
            AdapterSource::None => 0,
            AdapterSource::Random { count, .. } => *count,
            AdapterSource::Folder { adapters, .. } => adapters.len(),
        }
    }

    /// The largest rank, which the engine must reserve (0 without adapters).
    pub fn max_rank(&self) -> usize {
        self.ranks().into_iter().max().unwrap_or(0)
    }

    fn ranks(&self) -> Vec<usize> {
        match self {
            AdapterSource::None => Vec::new(),
            AdapterSource::Random { count, rank } => vec![*rank; *count],
            AdapterSource::Folder { adapters, .. } => adapters.iter().map(|a| a.rank).collect(),
        }
    }

    /// Turns LoRA on in `engine` with room for these adapters: their largest rank, each kept in
    /// host memory, and (`slot_each`) a GPU slot each, so that a batch runs all its sequences at
    /// once rather than measuring admission waits.
    pub fn reserve(&self, engine: &mut EngineArgs, slot_each: bool) {
        if self.count() == 0 {
            return;
        }
        engine.enable_lora = true;
        engine.max_lora_rank = engine.max_lora_rank.max(self.max_rank());
        engine.max_cpu_loras = engine.max_cpu_loras.max(self.count());
        if slot_each {
            engine.max_loras = engine.max_loras.max(self.count());
        }
    }

    /// Loads the adapters into the engine by name (random ones written first, seeded by `seed`).
    /// The names come back in the order [`AdapterSource::summary`] lists the ranks.
    pub fn load(&self, runtime: &Runtime, seed: u64) -> anyhow::Result<LoadedAdapters> {
        match self {
            AdapterSource::None => Ok(LoadedAdapters { names: Vec::new(), _scratch: None }),
            AdapterSource::Random { count, rank } => {
                let scratch = ScratchDir::new()?;
                let written = write_random_adapters(&runtime.model_config, *count, *rank, seed, &scratch.0)?;
                for (name, folder) in &written {
                    runtime.engine.load_adapter(name, folder)?;
                }
                Ok(LoadedAdapters { names: written.into_iter().map(|(name, _)| name).collect(), _scratch: Some(scratch) })
            }
            AdapterSource::Folder { adapters, .. } => {
                for a in adapters {
                    runtime.engine.load_adapter(&a.name, &a.path).with_context(|| format!("--lora-dir: adapter {:?}", a.name))?;
                }
                Ok(LoadedAdapters { names: adapters.iter().map(|a| a.name.clone()).collect(), _scratch: None })
            }
        }
    }

    pub fn summary(&self) -> AdapterSummary {
        let (source, from_folder) = match self {
            AdapterSource::Folder { dir, .. } => (dir.display().to_string(), true),
            _ => ("random".to_string(), false),
        };
        AdapterSummary { adapters: self.count(), rank: self.max_rank(), ranks: self.ranks(), source, from_folder }
    }
}

impl AdapterSummary {
    /// "4 adapters of rank 32" or "2 adapters from DIR (ranks 8, 16)".
    pub fn describe(&self) -> String {
        if !self.from_folder {
            return format!("{} adapters of rank {}", self.adapters, self.rank);
        }
        let ranks: Vec<String> = self.ranks.iter().map(|r| r.to_string()).collect();
        format!("{} adapters from {} (ranks {})", self.adapters, self.source, ranks.join(", "))
    }
}

/// The loaded adapters' names; random ones' files live as long as this.
pub struct LoadedAdapters {
    pub names: Vec<String>,
    _scratch: Option<ScratchDir>,
}

/// The PEFT adapters in `dir`: `dir` itself when it holds `adapter_config.json`, else each
/// subfolder that does (other entries are skipped), sorted by name. Each config is parsed here, so
/// an adapter the engine would refuse (DoRA, a bias, a bad rank) is named before the model loads.
pub fn scan_adapter_dir(dir: &Path) -> anyhow::Result<Vec<FolderAdapter>> {
    let read = |path: &Path| -> anyhow::Result<FolderAdapter> {
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "adapter".to_string());
        let config = AdapterConfig::from_file(&path.join(CONFIG_FILE)).with_context(|| format!("--lora-dir: adapter {name:?}"))?;
        Ok(FolderAdapter { name, path: path.to_path_buf(), rank: config.r })
    };
    if dir.join(CONFIG_FILE).is_file() {
        return Ok(vec![read(dir)?]);
    }
    let entries = std::fs::read_dir(dir).with_context(|| format!("--lora-dir {}: cannot read the folder", dir.display()))?;
    let mut adapters = Vec::new();
    for entry in entries {
        let path = entry.with_context(|| format!("--lora-dir {}: cannot list the folder", dir.display()))?.path();
        if path.join(CONFIG_FILE).is_file() {
            adapters.push(read(&path)?);
        }
    }
    if adapters.is_empty() {
        anyhow::bail!("--lora-dir {}: no PEFT adapter in it (a subfolder with {CONFIG_FILE} and adapter_model.safetensors)", dir.display());
    }
    adapters.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(adapters)
}

/// A private temporary folder for random adapters, removed on drop. Each gets its own name, so
/// that the cold-adapter samples' folder going away leaves the workload's adapters' folder alone.
pub(crate) struct ScratchDir(pub(crate) PathBuf);

impl ScratchDir {
    pub(crate) fn new() -> anyhow::Result<Self> {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("peregrine-bench-lora-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(ScratchDir(dir))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_adapters() -> PathBuf {
        peregrine_testkit::fixtures_dir().join("smollm2/lora")
    }

    /// A folder holding `adapter-a`'s config under each of `names` (the configs alone: enough for
    /// the scan, which reads no weights).
    fn folder_with(names: &[&str]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let config = std::fs::read(fixture_adapters().join("adapter-a").join(CONFIG_FILE)).unwrap();
        for name in names {
            std::fs::create_dir(dir.path().join(name)).unwrap();
            std::fs::write(dir.path().join(name).join(CONFIG_FILE), &config).unwrap();
        }
        dir
    }

    #[test]
    fn a_folder_of_adapters_gives_each_subfolder_by_name_with_its_rank() {
        let adapters = scan_adapter_dir(&fixture_adapters()).unwrap();
        let found: Vec<(&str, usize)> = adapters.iter().map(|a| (a.name.as_str(), a.rank)).collect();
        assert_eq!(found, [("adapter-a", 8), ("adapter-b", 16)]);
        assert_eq!(adapters[1].path, fixture_adapters().join("adapter-b"));
    }

    #[test]
    fn a_folder_that_is_one_adapter_gives_that_adapter() {
        let adapters = scan_adapter_dir(&fixture_adapters().join("adapter-b")).unwrap();
        assert_eq!(adapters.len(), 1);
        assert_eq!((adapters[0].name.as_str(), adapters[0].rank), ("adapter-b", 16));
    }

    #[test]
    fn entries_without_a_config_are_skipped_and_names_sorted() {
        let dir = folder_with(&["zeta", "alpha"]);
        std::fs::create_dir(dir.path().join("empty")).unwrap();
        std::fs::write(dir.path().join("README.md"), "not an adapter").unwrap();
        let names: Vec<String> = scan_adapter_dir(dir.path()).unwrap().into_iter().map(|a| a.name).collect();
        assert_eq!(names, ["alpha", "zeta"]);
    }

    #[test]
    fn a_folder_without_adapters_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = scan_adapter_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("no PEFT adapter"), "{err}");
        let missing = dir.path().join("nowhere");
        let err = scan_adapter_dir(&missing).unwrap_err().to_string();
        assert!(err.contains("cannot read the folder"), "{err}");
    }

    #[test]
    fn an_adapter_the_engine_would_refuse_is_named_before_the_model_loads() {
        let dir = folder_with(&["good"]);
        std::fs::create_dir(dir.path().join("dora")).unwrap();
        std::fs::write(dir.path().join("dora").join(CONFIG_FILE), r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "use_dora": true}"#).unwrap();
        let err = format!("{:#}", scan_adapter_dir(dir.path()).unwrap_err());
        assert!(err.contains("\"dora\"") && err.contains("DoRA"), "{err}");
    }

    #[test]
    fn lora_count_takes_the_first_adapters_and_cannot_exceed_the_folder() {
        let dir = fixture_adapters();
        let all = AdapterSource::from_flags(0, 16, Some(&dir)).unwrap();
        assert_eq!((all.count(), all.max_rank()), (2, 16));
        let first = AdapterSource::from_flags(1, 64, Some(&dir)).unwrap();
        // The folder's ranks, not --lora-rank's.
        assert_eq!((first.count(), first.max_rank()), (1, 8));
        let err = AdapterSource::from_flags(3, 16, Some(&dir)).unwrap_err().to_string();
        assert!(err.contains("--lora 3") && err.contains("(2)"), "{err}");
        assert_eq!(AdapterSource::from_flags(0, 16, None).unwrap(), AdapterSource::None);
        assert_eq!(AdapterSource::from_flags(4, 32, None).unwrap(), AdapterSource::Random { count: 4, rank: 32 });
    }

    #[test]
    fn reserving_makes_room_for_the_largest_rank_and_every_adapter() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            engine: EngineArgs,
        }
        let base = Cli::try_parse_from(["x", "--model", "m.gguf", "--max-lora-rank", "8", "--max-loras", "1", "--max-cpu-loras", "1"]).unwrap().engine;
        let source = AdapterSource::from_flags(0, 16, Some(&fixture_adapters())).unwrap();
        let mut engine = base.clone();
        source.reserve(&mut engine, true);
        assert!(engine.enable_lora);
        assert_eq!((engine.max_lora_rank, engine.max_loras, engine.max_cpu_loras), (16, 2, 2));
        let mut engine = base.clone();
        source.reserve(&mut engine, false);
        assert_eq!((engine.max_lora_rank, engine.max_loras, engine.max_cpu_loras), (16, 1, 2));
        let mut engine = base;
        AdapterSource::None.reserve(&mut engine, true);
        assert!(!engine.enable_lora);
    }

    #[test]
    fn the_summary_names_where_the_adapters_came_from() {
        let random = AdapterSource::Random { count: 4, rank: 32 }.summary();
        assert_eq!(random.describe(), "4 adapters of rank 32");
        let dir = fixture_adapters();
        let folder = AdapterSource::from_flags(0, 16, Some(&dir)).unwrap().summary();
        assert_eq!(folder.describe(), format!("2 adapters from {} (ranks 8, 16)", dir.display()));
        // A folder given as `--lora-dir random` is still a folder.
        let named_random = AdapterSource::Folder { dir: PathBuf::from("random"), adapters: scan_adapter_dir(&dir.join("adapter-a")).unwrap() };
        assert_eq!(named_random.summary().describe(), "1 adapters from random (ranks 8)");
    }

    #[test]
    fn scratch_folders_are_distinct_and_removed_on_drop() {
        let (a, b) = (ScratchDir::new().unwrap(), ScratchDir::new().unwrap());
        assert_ne!(a.0, b.0);
        let path = b.0.clone();
        drop(b);
        assert!(!path.exists() && a.0.exists());
    }
}
