//! The attention kernels (`Op::Attention`, `Op::AttentionGrad`) against a materialised softmax in
//! f64: causal or not, S != T, biases of several broadcast shapes, head widths 1, 8 and 64, lengths
//! that are not multiples of the kernels' tiles, several batch-heads; and the bits do not depend
//! on the thread count.

mod common;
use common::*;
use kiln_compiler::ir::Op;

/// The f64 reference: (output [.., S, D], dq, dk, dv) for the gradient `dout` of the output.
#[allow(clippy::type_complexity)]
fn reference(
    q: &T,
    k: &T,
    v: &T,
    bias: Option<&T>,
    dout: &T,
    scale: f32,
    causal: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let r = q.dims.len();
    let lead = &q.dims[..r - 2];
    let (s, t, d) = (q.dims[r - 2], k.dims[r - 2], q.dims[r - 1]);
    let bh: usize = lead.iter().product();
    let f = |x: &T, i: usize| x.data[i] as f64;
    let (mut o, mut dq, mut dk, mut dv) =
        (vec![0.0; bh * s * d], vec![0.0; bh * s * d], vec![0.0; bh * t * d], vec![0.0; bh * t * d]);
    for h in 0..bh {
        let mut lead_idx = unravel(h, lead);
        lead_idx.extend([0, 0]);
        for i in 0..s {
            let mut sc = vec![0.0f64; t];
            for (j, sc) in sc.iter_mut().enumerate() {
                let dotp: f64 = (0..d).map(|c| f(q, (h * s + i) * d + c) * f(k, (h * t + j) * d + c)).sum();
                *sc = scale as f64 * dotp;
                if let Some(b) = bias {
                    lead_idx[r - 2] = i;
                    lead_idx[r - 1] = j;
                    *sc += b.data[broadcast_index(&lead_idx, &b.dims)] as f64;
                }
                if causal && j + s > i + t {
                    *sc -= 1e9;
                }
            }
            let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
            let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
            let dp: Vec<f64> = (0..t)
                .map(|j| (0..d).map(|c| f(dout, (h * s + i) * d + c) * f(v, (h * t + j) * d + c)).sum())
                .collect();
            let dsum: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
            for j in 0..t {
                let ds = p[j] * (dp[j] - dsum) * scale as f64;
                for c in 0..d {
                    o[(h * s + i) * d + c] += p[j] * f(v, (h * t + j) * d + c);
                    dv[(h * t + j) * d + c] += p[j] * f(dout, (h * s + i) * d + c);
                    dq[(h * s + i) * d + c] += ds * f(k, (h * t + j) * d + c);
                    dk[(h * t + j) * d + c] += ds * f(q, (h * s + i) * d + c);
                }
            }
        }
    }
    (o, dq, dk, dv)
}

/// Checks the forward and gradient kernels on q [lead.., S, D], k and v [lead.., T, D].
fn check(lead: &[usize], s: usize, t: usize, d: usize, bias_dims: Option<&[usize]>, causal: bool, seed: u64) {
    let dims = |n: usize| [lead, &[n, d]].concat();
    let mut rng = Rng::new(seed);
    let (q, k, v, dout) = (
        rng.tensor(&dims(s), -1.0, 1.0),
        rng.tensor(&dims(t), -1.0, 1.0),
        rng.tensor(&dims(t), -1.0, 1.0),
        rng.tensor(&dims(s), -1.0, 1.0),
    );
    let bias = bias_dims.map(|b| {
        // A mix of mask values (-1e9) and small biases, every row keeping some keys.
        let mut x = rng.tensor(b, -1.0, 1.0);
        let last = *b.last().unwrap();
        for (n, e) in x.data.iter_mut().enumerate() {
            if last > 1 && n % last != 0 && n % 3 == 1 {
                *e = -1e9;
            }
        }
        x
    });
    let scale = 1.0 / (d as f32).sqrt() * 1.7;
    let (want_o, want_dq, want_dk, want_dv) = reference(&q, &k, &v, bias.as_ref(), &dout, scale, causal);
    let what = format!("lead {lead:?} S {s} T {t} D {d} bias {bias_dims:?} causal {causal}");
    let mut fwd: Vec<&T> = vec![&q, &k, &v];
    fwd.extend(bias.as_ref());
    let o = run(&Op::Attention { scale, causal }, &fwd);
    assert_eq!(o.dims, dims(s), "{what}");
    let check = |got: &[f32], want: &[f64], part: &str| {
        let worst =
            got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).abs() / (1.0 + w.abs())).fold(0.0, f64::max);
        assert!(got.iter().all(|g| g.is_finite()) && worst < 2e-4, "{what}: {part} off by {worst}");
    };
    check(&o.data, &want_o, "output");
    let mut bwd: Vec<&T> = vec![&q, &k, &v, &o, &dout];
    bwd.extend(bias.as_ref());
    let g = run(&Op::AttentionGrad { scale, causal }, &bwd);
    let bh: usize = lead.iter().product();
    assert_eq!(g.dims, dims(s + 2 * t), "{what}");
    let (mut dq, mut dk, mut dv) = (vec![], vec![], vec![]);
    for h in 0..bh {
        let blk = &g.data[h * (s + 2 * t) * d..(h + 1) * (s + 2 * t) * d];
        dq.extend_from_slice(&blk[..s * d]);
        dk.extend_from_slice(&blk[s * d..(s + t) * d]);
        dv.extend_from_slice(&blk[(s + t) * d..]);
    }
    check(&dq, &want_dq, "dq");
    check(&dk, &want_dk, "dk");
    check(&dv, &want_dv, "dv");
}

#[test]
fn attention_matches_the_materialised_softmax() {
    let mut seed = 1;
    for d in [1, 8, 64] {
        for (s, t) in [(1, 1), (5, 5), (17, 17), (70, 70), (13, 77), (77, 130), (20, 300), (40, 9)] {
            for causal in [false, true] {
                if causal && s > t {
                    // Rows that see no key attend uniformly in f32 only (-1e9 + x rounds).
                    continue;
                }
                seed += 1;
                check(&[2, 3], s, t, d, None, causal, seed);
            }
        }
    }
}

#[test]
fn attention_with_broadcast_biases() {
    let (lead, s, t) = ([2usize, 3usize], 19, 70);
    let shapes: [&[usize]; 6] =
        [&[2, 1, 1, 70], &[1, 1, 19, 70], &[19, 70], &[2, 3, 19, 70], &[70], &[2, 3, 19, 1]];
    let mut seed = 100;
    for d in [8, 64] {
        for b in shapes {
            for causal in [false, true] {
                seed += 1;
                check(&lead, s, t, d, Some(b), causal, seed);
            }
        }
    }
    // Rank 2 operands (one batch-head), and rank 3.
    check(&[], 33, 65, 8, Some(&[1, 65]), true, 7);
    check(&[5], 64, 64, 16, Some(&[5, 1, 64]), false, 8);
}

#[test]
fn attention_does_not_depend_on_the_thread_count() {
    let mut rng = Rng::new(5);
    let (q, k, v, dout) = (
        rng.tensor(&[3, 4, 100, 32], -1.0, 1.0),
        rng.tensor(&[3, 4, 130, 32], -1.0, 1.0),
        rng.tensor(&[3, 4, 130, 32], -1.0, 1.0),
        rng.tensor(&[3, 4, 100, 32], -1.0, 1.0),
    );
    let bias = rng.tensor(&[3, 1, 1, 130], -1.0, 1.0);
    for causal in [false, true] {
        let fwd = Op::Attention { scale: 0.3, causal };
        let bwd = Op::AttentionGrad { scale: 0.3, causal };
        let on = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let o = run(&fwd, &[&q, &k, &v, &bias]);
                let g = run(&bwd, &[&q, &k, &v, &o, &dout, &bias]);
                (
                    o.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    g.data.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                )
            })
        };
        let one = on(1);
        for threads in [2, 3, 8] {
            assert!(one == on(threads), "causal {causal}: {threads} threads");
        }
    }
}

/// Forward and gradient kernel times at b=4, h=12, s=256, d=64, causal:
/// `cargo test --release -p kiln-kernels --test attention -- --ignored --nocapture`.
#[test]
#[ignore]
fn time_kernels() {
    let mut rng = Rng::new(9);
    let dims = [4, 12, 256, 64];
    let (q, k, v, dout) = (
        rng.tensor(&dims, -1.0, 1.0),
        rng.tensor(&dims, -1.0, 1.0),
        rng.tensor(&dims, -1.0, 1.0),
        rng.tensor(&dims, -1.0, 1.0),
    );
    // A first round warms the thread pool and the allocator.
    for causal in [false, true, false, true] {
        let fwd = Op::Attention { scale: 0.125, causal };
        let bwd = Op::AttentionGrad { scale: 0.125, causal };
        let o = run(&fwd, &[&q, &k, &v]);
        let best = |op: &Op, inputs: &[&T]| {
            (0..5)
                .map(|_| {
                    let start = std::time::Instant::now();
                    run(op, inputs);
                    start.elapsed().as_secs_f64() * 1e3
                })
                .fold(f64::INFINITY, f64::min)
        };
        println!(
            "causal {causal}: forward {:.1} ms, gradient {:.1} ms",
            best(&fwd, &[&q, &k, &v]),
            best(&bwd, &[&q, &k, &v, &o, &dout])
        );
    }
}
