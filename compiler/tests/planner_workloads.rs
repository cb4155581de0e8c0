//! Arena / lower bound on generated workloads, printed as a table (`-- --nocapture`), with every
//! heuristic's ratio beside the winner's. Training steps must stay within 1% of the bound: the
//! figures are deterministic, so this holds on any machine.

use kiln_compiler::planner::workloads::{
    TransformerDims, chain, mlp_training, random_mix, transformer_training,
};
use kiln_compiler::planner::{Interval, lower_bound, naive_bytes, place, verify};

const ALIGN: usize = 256;

/// Plans, verifies and prints one row; returns arena / lower bound.
fn row(name: &str, ivs: &[Interval]) -> f64 {
    let p = place(ivs, ALIGN);
    verify(ivs, &p, ALIGN).unwrap();
    let bound = lower_bound(ivs, ALIGN).bytes;
    let naive = naive_bytes(ivs, ALIGN);
    assert!(bound <= p.arena_bytes && p.arena_bytes <= naive);
    let ratio = |a: usize| a as f64 / bound as f64;
    let tried: Vec<String> = p.tried.iter().map(|(h, a)| format!("{h} {:.4}", ratio(*a))).collect();
    println!(
        "{name:<34} {:>6} intervals  arena {:>8.1} MiB  bound {:>8.1} MiB  naive {:>9.1} MiB  arena/bound {:.4} ({})  [{}]",
        ivs.len(),
        p.arena_bytes as f64 / 1048576.0,
        bound as f64 / 1048576.0,
        naive as f64 / 1048576.0,
        ratio(p.arena_bytes),
        p.algorithm,
        tried.join(", ")
    );
    ratio(p.arena_bytes)
}

#[test]
fn training_steps_plan_close_to_the_bound() {
    let mlps: [(&str, usize, Vec<usize>); 4] = [
        ("mlp 784-512x4-10 b64", 64, vec![784, 512, 512, 512, 512, 10]),
        ("mlp 1024-4096/256 x3 b128", 128, vec![1024, 4096, 256, 4096, 256, 4096, 10]),
        ("mlp 100 layers 512..2048 b32", 32, (0..101).map(|i| [512, 1024, 2048, 768][i % 4]).collect()),
        ("mlp 1000 layers 512..2048 b32", 32, (0..1001).map(|i| [512, 1024, 2048, 768][i % 4]).collect()),
    ];
    for (name, batch, dims) in mlps {
        let r = row(name, &mlp_training(batch, &dims));
        assert!(r <= 1.01, "{name}: arena/bound {r}");
    }
    let transformers = [
        (
            "gpt2-small-like b8 s512 l12",
            TransformerDims {
                batch: 8,
                seq: 512,
                model: 768,
                heads: 12,
                layers: 12,
                deferred_updates: false,
            },
        ),
        (
            "b1 s1024 m1024 l24",
            TransformerDims {
                batch: 1,
                seq: 1024,
                model: 1024,
                heads: 16,
                layers: 24,
                deferred_updates: false,
            },
        ),
        (
            "b4 s2048 m4096 l4",
            TransformerDims {
                batch: 4,
                seq: 2048,
                model: 4096,
                heads: 32,
                layers: 4,
                deferred_updates: false,
            },
        ),
        (
            "b4 s128 m256 l345 (10k intervals)",
            TransformerDims {
                batch: 4,
                seq: 128,
                model: 256,
                heads: 4,
                layers: 345,
                deferred_updates: false,
            },
        ),
    ];
    for (name, dims) in transformers {
        let r = row(&format!("transformer {name}"), &transformer_training(dims));
        assert!(r <= 1.01, "{name}: arena/bound {r}");
        let dims = TransformerDims { deferred_updates: true, ..dims };
        let r = row(&format!("transformer {name}, deferred updates"), &transformer_training(dims));
        assert!(r <= 1.01, "{name}, deferred updates: arena/bound {r}");
    }
    let r = row("inference chain", &chain(1000, 3 << 20));
    assert_eq!(r, 1.0);
}

#[test]
fn random_mixes() {
    // Not graphs: sizes spread over five orders of magnitude with random lifetimes, the hardest
    // case for packing. Printed for comparison only.
    for (n, long) in [(2_000, 100), (2_000, 1_000), (10_000, 1_000), (10_000, 2_500)] {
        for seed in 0..3 {
            row(&format!("random mix n={n} long<{long} seed {seed}"), &random_mix(n, long, seed));
        }
    }
}
