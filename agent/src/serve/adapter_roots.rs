//! Where `POST /v1/load_lora_adapter` may read from (`--lora-root DIR`, repeatable). Roots and
//! requested paths are both canonicalised (symlinks resolved, `..` gone) before comparing, so a
//! link inside a root that points outside it is refused like the outside path itself.

use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default)]
pub struct AdapterRoots {
    /// Canonical. Empty: no restriction (a server without `--lora-root`).
    roots: Vec<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
#[error("--lora-root {path}: {source}")]
pub struct RootError {
    path: String,
    #[source]
    source: std::io::Error,
}

impl AdapterRoots {
    /// Canonicalises every root; a root that does not exist is a startup error (a typo would
    /// otherwise refuse every load).
    pub fn new(dirs: &[PathBuf]) -> Result<Self, RootError> {
        let roots = dirs
            .iter()
            .map(|d| std::fs::canonicalize(d).map_err(|source| RootError { path: d.display().to_string(), source }))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(AdapterRoots { roots })
    }

    pub fn is_restricted(&self) -> bool {
        !self.roots.is_empty()
    }

    /// The canonical path to load from, or None when `requested` is outside every root or cannot
    /// be resolved (missing, unreadable): the caller answers both alike.
    pub fn resolve(&self, requested: &str) -> Option<PathBuf> {
        let requested = Path::new(requested);
        if !self.is_restricted() {
            return Some(requested.to_path_buf());
        }
        // Relative paths would depend on the server's working directory.
        if !requested.is_absolute() {
            return None;
        }
        let canonical = std::fs::canonicalize(requested).ok()?;
        self.roots.iter().any(|root| canonical.starts_with(root)).then_some(canonical)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_inside_a_root_after_resolving_links() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("adapters");
        let outside = tmp.path().join("secret");
        std::fs::create_dir_all(root.join("a")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link-out")).unwrap();
        std::os::unix::fs::symlink(root.join("a"), tmp.path().join("link-in")).unwrap();
        // A root given through a `..` resolves to the same folder.
        let roots = AdapterRoots::new(&[tmp.path().join("secret/../adapters")]).unwrap();
        let canon_a = std::fs::canonicalize(root.join("a")).unwrap();

        assert_eq!(roots.resolve(root.join("a").to_str().unwrap()), Some(canon_a.clone()));
        assert_eq!(roots.resolve(tmp.path().join("link-in").to_str().unwrap()), Some(canon_a), "a link into a root is fine");
        assert_eq!(roots.resolve(root.join("link-out").to_str().unwrap()), None, "a link out of a root is not");
        assert_eq!(roots.resolve(root.join("../secret").to_str().unwrap()), None);
        assert_eq!(roots.resolve(outside.to_str().unwrap()), None);
        assert_eq!(roots.resolve(root.join("missing").to_str().unwrap()), None);
        assert_eq!(roots.resolve("/proc/self"), None);
        assert_eq!(roots.resolve("adapters/a"), None, "relative paths are refused");
        // A sibling whose name starts with the root's is not inside it.
        std::fs::create_dir_all(tmp.path().join("adapters-evil")).unwrap();
        assert_eq!(roots.resolve(tmp.path().join("adapters-evil").to_str().unwrap()), None);

        assert!(AdapterRoots::new(&[tmp.path().join("nope")]).is_err());
        assert_eq!(AdapterRoots::default().resolve("/any/where"), Some(PathBuf::from("/any/where")));
    }
}
