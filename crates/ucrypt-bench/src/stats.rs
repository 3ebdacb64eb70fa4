//! Medians and ranges over repeated runs, and a machine description and its load for reports.

use serde::Serialize;

/// Median, minimum and maximum of a set of samples (e.g. GB/s of each run).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
    pub runs: usize,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let mut v: Vec<f64> = samples.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let n = v.len();
        if n == 0 {
            return Summary {
                median: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
                runs: 0,
            };
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Summary {
            median,
            min: v[0],
            max: v[n - 1],
            runs: n,
        }
    }

    /// "12.3 (11.9–12.8)"
    pub fn show(&self, decimals: usize) -> String {
        format!(
            "{:.d$} ({:.d$}–{:.d$})",
            self.median,
            self.min,
            self.max,
            d = decimals
        )
    }
}

/// What the numbers were measured on.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cores: usize,
    pub aes_flags: Vec<String>,
    pub kernel: String,
}

impl Machine {
    pub fn detect() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let field = |name: &str| {
            cpuinfo
                .lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
                .unwrap_or_default()
        };
        let flags = field("flags");
        let aes_flags = ["aes", "vaes", "avx2", "avx512f", "vpclmulqdq"]
            .iter()
            .filter(|f| flags.split_whitespace().any(|x| x == **f))
            .map(|f| f.to_string())
            .collect();
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        Machine {
            cpu_model: field("model name"),
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            aes_flags,
            kernel,
        }
    }

    pub fn describe(&self) -> String {
        format!(
            "{} ({} cores; {}), kernel {}",
            self.cpu_model,
            self.cores,
            self.aes_flags.join(" "),
            self.kernel
        )
    }
}

/// The host's /proc/loadavg line: how busy the machine was around a measurement.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_rows() {
        // (samples, median, min, max)
        let rows: &[(&[f64], f64, f64, f64)] = &[
            (&[3.0, 1.0, 2.0], 2.0, 1.0, 3.0),
            (&[4.0, 1.0, 2.0, 3.0], 2.5, 1.0, 4.0),
            (&[5.0], 5.0, 5.0, 5.0),
            (&[1.0, f64::NAN, 3.0], 2.0, 1.0, 3.0),
        ];
        for (samples, med, min, max) in rows {
            let s = Summary::of(samples);
            assert_eq!((s.median, s.min, s.max), (*med, *min, *max), "{samples:?}");
        }
        assert_eq!(Summary::of(&[]).runs, 0);
    }
}
