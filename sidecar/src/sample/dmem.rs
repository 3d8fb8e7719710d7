//! Device memory charged to the trainer's cgroup by the cgroup v2 `dmem` controller (kernel ≥
//! 6.14; NVIDIA's driver charges it from r615 on): the GPU figure where NVML has none, e.g. a
//! MIG-less shared device whose per-container budget the driver enforces (issue 38, item 5).
//!
//! The files are nested-keyed, one region per line, as Documentation/admin-guide/cgroup-v2.rst
//! ("DMEM") writes them: `dmem.current` holds `<region> <bytes>`, `dmem.max` holds `<region>
//! <bytes>` or `<region> max` (e.g. `drm/0000:03:00.0/vram0 12550144`). A region with no byte
//! limit has no capacity known inside the container (`dmem.capacity` exists only on the root
//! cgroup), so it is left out: no ratio without a denominator.
//!
//! Untested on hardware: no device with the controller has been lent yet; the parser and the
//! reader are tested against files written as the kernel documents them, and the "not
//! available" path against this host's real cgroups.

use super::gpu::GpuMemory;
use super::{SampleError, read_opt};
use std::collections::BTreeMap;
use std::path::Path;

/// The controller's usage file in a cgroup v2 directory.
pub const CURRENT: &str = "dmem.current";
/// The controller's limit file.
pub const MAX: &str = "dmem.max";

/// `<region> <bytes|max>` lines: region → `Some(bytes)`, or `None` for `max`. A line that is
/// neither is an error naming it (never a silent 0).
pub fn parse_regions(text: &str) -> Result<BTreeMap<String, Option<u64>>, String> {
    let mut out = BTreeMap::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let mut parts = line.split_whitespace();
        let (Some(region), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("{line:?} is not `<region> <bytes>`"));
        };
        let value = match value {
            "max" => None,
            v => Some(
                v.parse::<u64>()
                    .map_err(|_| format!("{line:?}: {v:?} is neither bytes nor max"))?,
            ),
        };
        out.insert(region.to_string(), value);
    }
    Ok(out)
}

/// The device memory of the cgroup at `dir`, one entry per region that has a byte limit
/// (`uuid` is the region's name). `Ok(None)`: the controller is not there (no `dmem.current`:
/// an older kernel, or the controller not enabled for this cgroup).
pub fn read(dir: &Path) -> Result<Option<Vec<GpuMemory>>, SampleError> {
    let Some(current) = read_opt(&dir.join(CURRENT))? else {
        return Ok(None);
    };
    let parse = |name: &str, text: &str| {
        parse_regions(text).map_err(|what| SampleError::Parse {
            path: dir.join(name),
            what,
        })
    };
    let used = parse(CURRENT, &current)?;
    let limits = match read_opt(&dir.join(MAX))? {
        Some(text) => parse(MAX, &text)?,
        None => BTreeMap::new(),
    };
    Ok(Some(
        used.into_iter()
            .filter_map(|(region, used)| {
                let total = limits.get(&region).copied().flatten()?;
                Some(GpuMemory {
                    uuid: region,
                    used_bytes: used?,
                    total_bytes: total,
                })
            })
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// As Documentation/admin-guide/cgroup-v2.rst shows `dmem.current`: a GPU's VRAM and its
    /// stolen memory, one line each.
    const CURRENT_TEXT: &str = "drm/0000:03:00.0/vram0 12550144\ndrm/0000:03:00.0/stolen 8650752\n";

    #[test]
    fn regions_parse_as_the_kernel_writes_them_and_garbage_is_named() {
        let r = parse_regions(CURRENT_TEXT).expect("parses");
        assert_eq!(r.get("drm/0000:03:00.0/vram0"), Some(&Some(12_550_144)));
        assert_eq!(r.len(), 2);
        let m = parse_regions("drm/0000:03:00.0/vram0 max\n").expect("max");
        assert_eq!(m.get("drm/0000:03:00.0/vram0"), Some(&None));
        for bad in ["vram0", "vram0 12 13", "vram0 -1", "vram0 12k"] {
            let err = parse_regions(bad).expect_err(bad);
            assert!(err.contains("vram0"), "{err}");
        }
        assert!(parse_regions("").expect("empty").is_empty());
    }

    #[test]
    fn a_limited_region_is_a_device_and_an_unlimited_one_is_left_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        fs::write(dir.path().join(CURRENT), CURRENT_TEXT).expect("w");
        fs::write(
            dir.path().join(MAX),
            "drm/0000:03:00.0/vram0 25165824\ndrm/0000:03:00.0/stolen max\n",
        )
        .expect("w");
        let gpus = read(dir.path()).expect("reads").expect("available");
        assert_eq!(
            gpus,
            vec![GpuMemory {
                uuid: "drm/0000:03:00.0/vram0".into(),
                used_bytes: 12_550_144,
                total_bytes: 25_165_824,
            }]
        );
        assert_eq!(gpus[0].ratio(), Some(12_550_144.0 / 25_165_824.0));
        fs::write(dir.path().join(MAX), "drm/0000:03:00.0/vram0 garbage\n").expect("w");
        assert!(matches!(read(dir.path()), Err(SampleError::Parse { .. })));
    }

    #[test]
    fn the_controller_is_not_available_on_this_hosts_real_cgroups() {
        // This kernel has no dmem controller: its real memory cgroup (v1 or v2) has no
        // dmem.current, which reads as "not available", not as an error or a 0.
        let own = std::fs::read_to_string("/proc/self/cgroup").expect("procfs");
        let root = Path::new("/sys/fs/cgroup");
        let dir = super::super::cgroup::Layout::detect(root)
            .and_then(|l| l.memory_dir(root, &own))
            .expect("this process's memory cgroup is visible");
        assert!(dir.is_dir(), "{}", dir.display());
        assert_eq!(read(&dir).expect("no error"), None);
        assert_eq!(read(root).expect("no error"), None);
    }
}
