//! Autotuning of the coordinator's two knobs — the fusion threshold and the cycle time — from
//! the throughput it observes (bytes of tensors made ready per second), as Horovod's
//! `HOROVOD_AUTOTUNE` does, but with a plain coordinate search instead of Bayesian
//! optimisation: first the fusion threshold (at the initial cycle time), then the cycle time
//! (at the best threshold). Each candidate is scored by the median of a few samples; a sample
//! spans a fixed number of training steps, a step being one more appearance of the first
//! tensor name the sample saw. Knobs the user set explicitly are not tuned. Once every
//! candidate is scored the best is kept for the rest of the job.

use std::fmt::Write as _;
use std::fs::File;
use std::io::Write;
use std::time::{Duration, Instant};

pub use crate::config::AutotuneConfig;

/// The knob values in force.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Fusion threshold in bytes.
    pub fusion_threshold: usize,
    /// Coordinator batching window.
    pub cycle_time: Duration,
}

const FUSION_CANDIDATES: [usize; 5] = [1 << 20, 4 << 20, 16 << 20, 64 << 20, 128 << 20];
const CYCLE_CANDIDATES_US: [u64; 4] = [0, 500, 2_000, 5_000];

/// The tuner's state machine, fed by the coordinator.
pub struct Autotuner {
    cfg: AutotuneConfig,
    stage: Stage,
    candidates: Vec<Knobs>,
    current: usize,
    scores: Vec<f64>,
    samples: Vec<f64>,
    warmup_left: usize,
    marker: Option<String>,
    steps: usize,
    bytes: u64,
    started: Instant,
    best: Knobs,
    log: Option<File>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stage {
    Fusion,
    Cycle,
    Done,
}

impl Autotuner {
    /// A tuner starting from `initial`.
    pub fn new(cfg: AutotuneConfig, initial: Knobs) -> Autotuner {
        let log = cfg.log_path.as_ref().and_then(|p| {
            let mut f = File::create(p).ok()?;
            let _ = writeln!(
                f,
                "stage,cycle_time_ms,fusion_threshold_bytes,score_bytes_per_s"
            );
            Some(f)
        });
        let mut t = Autotuner {
            warmup_left: cfg.warmup_samples,
            stage: Stage::Fusion,
            candidates: Vec::new(),
            current: 0,
            scores: Vec::new(),
            samples: Vec::new(),
            marker: None,
            steps: 0,
            bytes: 0,
            started: Instant::now(),
            best: initial,
            log,
            cfg,
        };
        t.enter(if t.cfg.tune_fusion {
            Stage::Fusion
        } else {
            Stage::Cycle
        });
        t
    }

    fn enter(&mut self, stage: Stage) {
        self.stage = stage;
        self.current = 0;
        self.scores.clear();
        self.samples.clear();
        self.candidates = match stage {
            Stage::Fusion => FUSION_CANDIDATES
                .iter()
                .map(|&f| Knobs {
                    fusion_threshold: f,
                    ..self.best
                })
                .collect(),
            Stage::Cycle if self.cfg.tune_cycle => CYCLE_CANDIDATES_US
                .iter()
                .map(|&us| Knobs {
                    cycle_time: Duration::from_micros(us),
                    ..self.best
                })
                .collect(),
            _ => {
                self.stage = Stage::Done;
                if let Some(f) = self.log.as_mut() {
                    let _ = writeln!(
                        f,
                        "best,{},{},",
                        self.best.cycle_time.as_secs_f64() * 1e3,
                        self.best.fusion_threshold
                    );
                }
                Vec::new()
            }
        };
    }

    /// The knobs to use now.
    pub fn knobs(&self) -> Knobs {
        if self.stage == Stage::Done {
            self.best
        } else {
            self.candidates[self.current]
        }
    }

    /// Whether tuning has finished.
    pub fn settled(&self) -> bool {
        self.stage == Stage::Done
    }

    /// Records that `name` (carrying `bytes`) became ready. Returns the new knobs when they
    /// change.
    pub fn observe(&mut self, name: &str, bytes: usize) -> Option<Knobs> {
        self.observe_at(name, bytes, Instant::now())
    }

    /// [`Autotuner::observe`] at the instant `now`, so that the search can be driven by a clock
    /// other than the wall's.
    fn observe_at(&mut self, name: &str, bytes: usize, now: Instant) -> Option<Knobs> {
        if self.stage == Stage::Done {
            return None;
        }
        self.bytes += bytes as u64;
        match &self.marker {
            None => {
                self.marker = Some(name.to_string());
                self.started = now;
                self.bytes = 0;
                return None;
            }
            Some(m) if m == name => self.steps += 1,
            Some(_) => return None,
        }
        if self.steps < self.cfg.steps_per_sample {
            return None;
        }
        let elapsed = now.saturating_duration_since(self.started);
        let score = self.bytes as f64 / elapsed.as_secs_f64().max(1e-9);
        self.marker = None;
        self.steps = 0;
        if self.warmup_left > 0 {
            self.warmup_left -= 1;
            return None;
        }
        let k = self.knobs();
        if let Some(f) = self.log.as_mut() {
            let stage = if self.stage == Stage::Fusion {
                "fusion"
            } else {
                "cycle"
            };
            let _ = writeln!(
                f,
                "{stage},{},{},{score:.0}",
                k.cycle_time.as_secs_f64() * 1e3,
                k.fusion_threshold
            );
        }
        self.samples.push(score);
        if self.samples.len() < self.cfg.samples_per_candidate {
            return None;
        }
        let mut s = std::mem::take(&mut self.samples);
        s.sort_by(|a, b| a.total_cmp(b));
        self.scores.push(s[s.len() / 2]);
        self.current += 1;
        if self.current == self.candidates.len() {
            let best = (0..self.scores.len())
                .max_by(|&a, &b| self.scores[a].total_cmp(&self.scores[b]))
                .expect("candidates are never empty");
            self.best = self.candidates[best];
            let mut summary = String::new();
            for (c, sc) in self.candidates.iter().zip(&self.scores) {
                let _ = write!(
                    summary,
                    " [{:.1} ms, {} MiB: {:.0} MB/s]",
                    c.cycle_time.as_secs_f64() * 1e3,
                    c.fusion_threshold >> 20,
                    sc / 1e6
                );
            }
            log::info!(target: crate::LOG_TARGET, "autotune scores:{summary}");
            let next = if self.stage == Stage::Fusion {
                Stage::Cycle
            } else {
                Stage::Done
            };
            self.enter(next);
            if self.settled() {
                log::info!(
                    target: crate::LOG_TARGET,
                    "autotune settled: fusion threshold {} bytes, cycle time {:.1} ms",
                    self.best.fusion_threshold,
                    self.best.cycle_time.as_secs_f64() * 1e3
                );
            }
        }
        Some(self.knobs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_every_candidate_then_keeps_the_best() {
        let cfg = AutotuneConfig {
            tune_fusion: true,
            tune_cycle: true,
            warmup_samples: 1,
            steps_per_sample: 2,
            samples_per_candidate: 1,
            log_path: None,
        };
        let initial = Knobs {
            fusion_threshold: 128 << 20,
            cycle_time: Duration::ZERO,
        };
        let mut t = Autotuner::new(cfg, initial);
        let mut seen = Vec::new();
        // A simulated clock: a wall-clock sleep on a loaded machine can take longer than the
        // next candidate's, and the scores would then rank the candidates by the machine's noise.
        let mut now = Instant::now();
        for _ in 0..400 {
            // bigger fusion thresholds "cost" more time per step here
            let k = t.knobs();
            seen.push(k);
            now += Duration::from_micros((k.fusion_threshold >> 20) as u64 * 20 + 100);
            t.observe_at("a", 1000, now);
            t.observe_at("b", 1000, now);
            if t.settled() {
                break;
            }
        }
        assert!(t.settled());
        assert_eq!(
            t.knobs().fusion_threshold,
            1 << 20,
            "the cheapest threshold wins"
        );
        for f in FUSION_CANDIDATES {
            assert!(seen.iter().any(|k| k.fusion_threshold == f), "tried {f}");
        }
    }
}
