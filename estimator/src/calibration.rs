//! Learning from past runs: a median correction factor over (estimate, measured peak) pairs.

use crate::units::Bytes;

/// Fewer runs than this and the estimate stays uncorrected: one odd run must not steer the plan.
pub const MIN_RUNS: usize = 3;
/// The factor is clamped to this range, so a corrupt record cannot shrink an estimate to nothing
/// or inflate it past reason.
pub const FACTOR_RANGE: (f64, f64) = (0.5, 3.0);

/// A multiplicative correction applied to estimates (1.0 = none).
#[derive(Debug, Clone, Copy, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Calibration {
    /// measured / estimated, median over the runs, clamped to [`FACTOR_RANGE`].
    pub factor: f64,
    /// How many runs the factor rests on (0 for none).
    pub runs: usize,
}

impl Calibration {
    /// No correction.
    pub const fn none() -> Calibration {
        Calibration {
            factor: 1.0,
            runs: 0,
        }
    }

    /// The median of measured/estimated over valid pairs, once [`MIN_RUNS`] or more exist.
    /// Pairs with a zero on either side are ignored: they carry no information.
    pub fn from_runs(runs: &[(Bytes, Bytes)]) -> Calibration {
        let mut ratios: Vec<f64> = runs
            .iter()
            .filter(|(est, measured)| est.0 > 0 && measured.0 > 0)
            .map(|(est, measured)| measured.as_f64() / est.as_f64())
            .collect();
        if ratios.len() < MIN_RUNS {
            return Calibration {
                factor: 1.0,
                runs: ratios.len(),
            };
        }
        ratios.sort_by(f64::total_cmp);
        let n = ratios.len();
        let median = if n % 2 == 1 {
            ratios[n / 2]
        } else {
            (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0
        };
        Calibration {
            factor: median.clamp(FACTOR_RANGE.0, FACTOR_RANGE.1),
            runs: n,
        }
    }

    /// Whether this calibration changes anything.
    pub fn is_active(&self) -> bool {
        self.runs >= MIN_RUNS && self.factor != 1.0
    }

    /// Applies the factor to a byte count.
    pub fn apply(&self, bytes: Bytes) -> Bytes {
        if self.runs < MIN_RUNS {
            return bytes;
        }
        Bytes::from_f64(bytes.as_f64() * self.factor)
    }
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runs(pairs: &[(u64, u64)]) -> Vec<(Bytes, Bytes)> {
        pairs.iter().map(|&(e, m)| (Bytes(e), Bytes(m))).collect()
    }

    #[test]
    fn needs_three_runs_before_correcting() {
        let c = Calibration::from_runs(&runs(&[(100, 150), (100, 150)]));
        assert_eq!(c.factor, 1.0);
        assert_eq!(c.apply(Bytes(100)), Bytes(100));
        assert!(!c.is_active());
    }

    #[test]
    fn takes_the_median_not_the_mean() {
        let c = Calibration::from_runs(&runs(&[(100, 110), (100, 120), (100, 290)]));
        assert!((c.factor - 1.2).abs() < 1e-9);
        assert_eq!(c.apply(Bytes(1000)), Bytes(1200));
        let even = Calibration::from_runs(&runs(&[(100, 110), (100, 120), (100, 130), (100, 900)]));
        assert!((even.factor - 1.25).abs() < 1e-9);
    }

    #[test]
    fn clamps_absurd_factors_and_ignores_zeros() {
        let c = Calibration::from_runs(&runs(&[(100, 10_000), (100, 10_000), (100, 10_000)]));
        assert_eq!(c.factor, FACTOR_RANGE.1);
        let z = Calibration::from_runs(&runs(&[(0, 100), (100, 0), (100, 120), (100, 120)]));
        assert_eq!(z.runs, 2);
        assert_eq!(z.factor, 1.0);
    }
}
