//! GPU memory: NVML through nvml-wrapper (feature `nvml`, library loaded at run time), or nothing.
//! No library or no device is the normal CPU case: [`NoGpu`], logged once at info.
//! NVML reports host PIDs, so only device-wide figures are used, never per-process ones.

/// The variable the NVIDIA container runtime sets to the pod's devices.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// Memory of one device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMemory {
    /// Device UUID (`GPU-…`) or index when the UUID is unknown.
    pub uuid: String,
    /// Bytes used on the device.
    pub used_bytes: u64,
    /// Device capacity, bytes.
    pub total_bytes: u64,
}

impl GpuMemory {
    /// used / total (`None` for a device reporting 0 total).
    pub fn ratio(&self) -> Option<f64> {
        (self.total_bytes > 0).then(|| self.used_bytes as f64 / self.total_bytes as f64)
    }
}

/// A GPU sampling failure (counted, never fatal).
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[error("gpu: {0}")]
pub struct GpuError(pub String);

/// Where GPU memory figures come from.
pub trait GpuSource: Send {
    /// The pod's devices now (empty: none).
    fn sample(&mut self) -> Result<Vec<GpuMemory>, GpuError>;
    /// A word for logs.
    fn describe(&self) -> String;
}

/// No GPU: the normal case on CPU nodes.
#[derive(Debug, Default, Clone)]
pub struct NoGpu {
    /// Why (for the startup log).
    pub why: String,
}

impl GpuSource for NoGpu {
    fn sample(&mut self) -> Result<Vec<GpuMemory>, GpuError> {
        Ok(Vec::new())
    }
    fn describe(&self) -> String {
        format!("none ({})", self.why)
    }
}

/// Which devices `NVIDIA_VISIBLE_DEVICES` names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Visible {
    /// Unset, empty, `void` or `none`: no GPU for this pod.
    None,
    /// `all`.
    All,
    /// UUIDs (`GPU-…`, `MIG-…`) or indexes.
    List(Vec<String>),
}

/// Parses `NVIDIA_VISIBLE_DEVICES`.
pub fn parse_visible(value: Option<&str>) -> Visible {
    match value.map(str::trim) {
        None | Some("") | Some("void") | Some("none") => Visible::None,
        Some("all") => Visible::All,
        Some(list) => Visible::List(
            list.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
        ),
    }
}

/// The highest used/total among devices.
pub fn max_ratio(devices: &[GpuMemory]) -> Option<f64> {
    devices.iter().filter_map(GpuMemory::ratio).reduce(f64::max)
}

/// Opens the best GPU source for `visible`: NVML when built in, loadable and it sees a device;
/// otherwise [`NoGpu`] with the reason.
pub fn open(visible: &Visible) -> Box<dyn GpuSource> {
    if *visible == Visible::None {
        return Box::new(NoGpu {
            why: "NVIDIA_VISIBLE_DEVICES names no device".into(),
        });
    }
    open_nvml(visible)
}

#[cfg(feature = "nvml")]
fn open_nvml(visible: &Visible) -> Box<dyn GpuSource> {
    match nvml::NvmlSource::init(visible.clone()) {
        Ok(src) => Box::new(src),
        Err(why) => Box::new(NoGpu { why }),
    }
}

#[cfg(not(feature = "nvml"))]
fn open_nvml(_: &Visible) -> Box<dyn GpuSource> {
    Box::new(NoGpu {
        why: "built without the nvml feature".into(),
    })
}

#[cfg(feature = "nvml")]
mod nvml {
    use super::{GpuError, GpuMemory, GpuSource, Visible};
    use nvml_wrapper::Nvml;

    /// Device memory through NVML.
    pub struct NvmlSource {
        nvml: Nvml,
        visible: Visible,
    }

    impl NvmlSource {
        /// Loads libnvidia-ml and checks that at least one device answers.
        pub fn init(visible: Visible) -> Result<Self, String> {
            let nvml = Nvml::init().map_err(|e| format!("NVML not available: {e}"))?;
            let mut src = NvmlSource { nvml, visible };
            match src.sample() {
                Ok(d) if !d.is_empty() => Ok(src),
                Ok(_) => Err("NVML loaded but sees no device".into()),
                Err(e) => Err(e.0),
            }
        }
    }

    impl GpuSource for NvmlSource {
        fn sample(&mut self) -> Result<Vec<GpuMemory>, GpuError> {
            let err = |e: nvml_wrapper::error::NvmlError| GpuError(e.to_string());
            let devices = match &self.visible {
                Visible::None => Vec::new(),
                Visible::All => {
                    let n = self.nvml.device_count().map_err(err)?;
                    (0..n)
                        .map(|i| self.nvml.device_by_index(i).map_err(err))
                        .collect::<Result<Vec<_>, _>>()?
                }
                Visible::List(ids) => ids
                    .iter()
                    .map(|id| match id.parse::<u32>() {
                        Ok(i) => self.nvml.device_by_index(i).map_err(err),
                        Err(_) => self.nvml.device_by_uuid(id.as_str()).map_err(err),
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            };
            devices
                .iter()
                .map(|d| {
                    let m = d.memory_info().map_err(err)?;
                    Ok(GpuMemory {
                        uuid: d.uuid().unwrap_or_else(|_| "unknown".into()),
                        used_bytes: m.used,
                        total_bytes: m.total,
                    })
                })
                .collect()
        }

        fn describe(&self) -> String {
            format!("nvml ({:?})", self.visible)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A scripted GPU for tests of the GPU path.
    pub struct FakeGpu(pub Vec<Result<Vec<GpuMemory>, GpuError>>);

    impl GpuSource for FakeGpu {
        fn sample(&mut self) -> Result<Vec<GpuMemory>, GpuError> {
            if self.0.is_empty() {
                Ok(Vec::new())
            } else {
                self.0.remove(0)
            }
        }
        fn describe(&self) -> String {
            "fake".into()
        }
    }

    fn dev(uuid: &str, used: u64, total: u64) -> GpuMemory {
        GpuMemory {
            uuid: uuid.into(),
            used_bytes: used,
            total_bytes: total,
        }
    }

    #[test]
    fn parses_nvidia_visible_devices() {
        assert_eq!(parse_visible(None), Visible::None);
        assert_eq!(parse_visible(Some("void")), Visible::None);
        assert_eq!(parse_visible(Some("all")), Visible::All);
        assert_eq!(
            parse_visible(Some("GPU-8f2e1c3a-aaaa-bbbb-cccc-0123456789ab, 1")),
            Visible::List(vec![
                "GPU-8f2e1c3a-aaaa-bbbb-cccc-0123456789ab".into(),
                "1".into()
            ])
        );
    }

    #[test]
    fn the_most_loaded_device_sets_the_ratio() {
        let mut gpu = FakeGpu(vec![
            Ok(vec![
                dev("GPU-a", 40, 80),
                dev("GPU-b", 72, 80),
                dev("GPU-c", 1, 0),
            ]),
            Err(GpuError("Xid 79".into())),
        ]);
        let d = gpu.sample().expect("ok");
        assert_eq!(max_ratio(&d), Some(0.9));
        assert!(gpu.sample().is_err());
        assert_eq!(max_ratio(&gpu.sample().expect("ok")), None);
    }

    #[test]
    fn no_visible_device_is_no_gpu_without_touching_nvml() {
        let mut g = open(&Visible::None);
        assert_eq!(g.sample(), Ok(Vec::new()));
        assert!(g.describe().starts_with("none"));
    }

    /// Real: this machine has no NVIDIA driver, so NVML fails to load and the sidecar falls back.
    #[test]
    fn nvml_absent_is_the_normal_cpu_case() {
        if std::path::Path::new("/dev/nvidiactl").exists() {
            eprintln!("NOTE: a GPU is present here; the no-NVML path is not exercised");
            return;
        }
        let mut g = open(&Visible::All);
        assert_eq!(g.sample(), Ok(Vec::new()));
        assert!(g.describe().starts_with("none"), "{}", g.describe());
    }
}
