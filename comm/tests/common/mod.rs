//! The checks that both the in-process tests (`tests/local.rs`) and the MPI program
//! (`examples/mpi_check.rs`) run on every rank of a group.
//!
//! Every rank can compute every rank's input, so each rank compares its results with a serial
//! rank-order sum of its own, bit for bit: passing on every rank means identical on every rank.

#![allow(dead_code)]

use kiln_comm::{CommError, Communicator, shard_range};

/// The buffer lengths every collective is checked with (uneven shards and empty ones included).
pub const LENGTHS: [usize; 5] = [0, 1, 2, 7, 1000];

/// Rank `rank`'s input of `len` elements: signs and magnitudes vary enough (2^-12 .. 2^12) that
/// summing in another order gives other bits. Element 0 is `-0.0` on every rank, which a sum
/// started from `0.0` would turn into `+0.0`.
pub fn input(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            if i == 0 {
                return -0.0;
            }
            let h = splitmix(((rank as u64) << 32) ^ i as u64);
            let mantissa = (h >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let exponent = ((h >> 8) % 25) as i32 - 12;
            let sign = if h & 1 == 0 { 1.0 } else { -1.0 };
            sign * (1.0 + mantissa) * 2f32.powi(exponent)
        })
        .collect()
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The elementwise sum of `size` ranks' inputs, added serially in rank order from rank 0's value.
pub fn serial_sum(len: usize, size: usize) -> Vec<f32> {
    let mut sum = input(0, len);
    for r in 1..size {
        for (s, x) in sum.iter_mut().zip(input(r, len)) {
            *s += x;
        }
    }
    sum
}

/// `Err` describing the first element whose bits differ.
pub fn same_bits(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{what}: {} elements, expected {}", got.len(), want.len()));
    }
    match got.iter().zip(want).position(|(g, w)| g.to_bits() != w.to_bits()) {
        Some(i) => Err(format!("{what}: element {i} is {:e}, expected {:e} (bit for bit)", got[i], want[i])),
        None => Ok(()),
    }
}

/// One named check's outcome on this rank.
pub type Outcome = (String, Result<(), String>);

/// The four collectives at every length in `LENGTHS`, against serial rank-order sums.
pub fn check_collectives(comm: &mut dyn Communicator) -> Vec<Outcome> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut out = Vec::new();
    for len in LENGTHS {
        let want = serial_sum(len, size);

        let mut buf = input(rank, len);
        let res = comm.all_reduce_sum(&mut buf).map_err(|e| e.to_string());
        out.push((format!("all_reduce_sum len {len}"), res.and_then(|()| same_bits("sum", &buf, &want))));

        let range = shard_range(len, rank, size);
        let mut shard = vec![f32::NAN; range.len()];
        let res = comm.reduce_scatter_sum(&input(rank, len), &mut shard).map_err(|e| e.to_string());
        let res = res.and_then(|()| same_bits("shard", &shard, &want[range.clone()]));
        out.push((format!("reduce_scatter_sum len {len}"), res));

        let mut gathered = vec![f32::NAN; len];
        let res = comm.all_gather(&input(rank, len)[range], &mut gathered).map_err(|e| e.to_string());
        let want_gathered: Vec<f32> =
            (0..size).flat_map(|r| input(r, len)[shard_range(len, r, size)].to_vec()).collect();
        let res = res.and_then(|()| same_bits("gathered", &gathered, &want_gathered));
        out.push((format!("all_gather len {len}"), res));

        for root in 0..size {
            let mut buf = input(rank, len);
            let res = comm.broadcast(&mut buf, root).map_err(|e| e.to_string());
            let res = res.and_then(|()| same_bits("broadcast", &buf, &input(root, len)));
            out.push((format!("broadcast root {root} len {len}"), res));
        }
    }
    let res = comm.barrier().map_err(|e| e.to_string());
    out.push(("barrier".to_string(), res));
    out
}

/// `Ok` when `res` is an error whose message contains every one of `needles`.
fn fails_with(res: kiln_comm::Result<()>, needles: &[&str]) -> Result<(), String> {
    match res {
        Ok(()) => Err("succeeded, expected an error".to_string()),
        Err(e) => {
            let msg = e.to_string();
            match needles.iter().find(|n| !msg.contains(*n)) {
                Some(n) => Err(format!("the error does not mention {n:?}: {msg}")),
                None => Ok(()),
            }
        }
    }
}

/// `agree` and the mistakes every rank must report alike: unequal fingerprints, lengths and
/// roots, and mismatched calls. Each mistake is followed by a call that must still work.
pub fn check_mistakes(comm: &mut dyn Communicator) -> Vec<Outcome> {
    let (rank, size) = (comm.rank(), comm.size());
    let mut out = Vec::new();
    let plan: Vec<u8> = (0..32).collect();
    out.push(("agree, equal fingerprints".to_string(), comm.agree("plan", &plan).map_err(|e| e.to_string())));

    // Rank 0's shard is one element too long.
    let mut shard = vec![0.0; shard_range(7, rank, size).len() + usize::from(rank == 0)];
    let res = comm.reduce_scatter_sum(&input(rank, 7), &mut shard);
    let expected = format!("shard_range(7, 0, {size}) has {}", shard_range(7, 0, size).len());
    out.push((
        "reduce_scatter_sum, wrong shard".to_string(),
        fails_with(res, &["reduce_scatter_sum", &expected]),
    ));

    let mut buf = vec![0.0; 3];
    let res = comm.broadcast(&mut buf, size);
    out.push(("broadcast, root out of range".to_string(), fails_with(res, &["broadcast", "root"])));

    let mut buf = input(rank, 2);
    let res = comm.all_reduce_sum(&mut buf).map_err(|e| e.to_string());
    out.push((
        "all_reduce_sum after a mistake".to_string(),
        res.and_then(|()| same_bits("sum", &buf, &serial_sum(2, size))),
    ));

    if size < 2 {
        return out;
    }
    let last = size - 1;

    let mut fingerprint = plan.clone();
    if rank == last {
        fingerprint[20] = 0xee;
    }
    let res = comm.agree("plan", &fingerprint);
    let others = if last == 1 {
        "rank 0 holds".to_string()
    } else {
        format!("ranks {} hold", (0..last).map(|r| r.to_string()).collect::<Vec<_>>().join(", "))
    };
    let last_holds = format!("rank {last} holds");
    out.push((
        "agree, unequal fingerprints".to_string(),
        fails_with(res, &["agree(plan)", &others, &last_holds, "ee"]),
    ));

    let len = if rank == last { 8 } else { 7 };
    let mut buf = vec![1.0; len];
    let res = comm.all_reduce_sum(&mut buf);
    let lens = format!("rank {last} passed 8");
    out.push((
        "all_reduce_sum, unequal lengths".to_string(),
        fails_with(res, &["all_reduce_sum", "passed 7", &lens]),
    ));

    let len = if rank == last { 5 } else { 6 };
    let mut out_buf = vec![0.0; len];
    let res = comm.all_gather(&[], &mut out_buf);
    out.push((
        "all_gather, unequal lengths".to_string(),
        fails_with(res, &["all_gather", "passed 6", "passed 5"]),
    ));

    let res = if rank == 0 { comm.barrier() } else { comm.all_reduce_sum(&mut [1.0]) };
    out.push(("mismatched calls".to_string(), fails_with(res, &["rank 0 called barrier", "all_reduce_sum"])));

    out.push(("barrier after the mistakes".to_string(), comm.barrier().map_err(|e| e.to_string())));
    out
}

/// Whether `err` says that `rank` left.
pub fn is_peer_left(err: &CommError, rank: usize) -> bool {
    matches!(err, CommError::PeerLeft { rank: r, .. } if *r == rank)
}
