use kiln::compiler::step::train_step_graph;
use kiln::prelude::*;
use kiln::runtime::{Backend, CpuBackend};
use std::time::Instant;
fn main() {
    for name in ["cnn", "transformer"] {
        let m = kiln::zoo::by_name(name).unwrap();
        let g = train_step_graph(&m.model(), m.x_shape(), m.y_shape(), &m.config()).unwrap();
        let (x, y) = m.batch_data(1).unwrap();
        let mut progs = vec![];
        for on in [true, false] {
            let t = Instant::now();
            let p = compile(g.clone(), &CompileOptions::default().with_cheap_remat(on)).unwrap();
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let mut b = CpuBackend::new(1);
            let id = b.load(p.clone()).unwrap();
            for _ in 0..2 {
                b.call(id, &[("x", &x), ("y", &y)]).unwrap();
            }
            println!(
                "{name} cheap_remat={on} compile {ms:.1} ms arena {} recomputed {:?}",
                p.memory.arena_bytes,
                p.memory.remat.as_ref().map(|r| r.recomputed.clone())
            );
            progs.push((on, b, id, vec![]));
        }
        for _ in 0..4 {
            for (_, b, id, v) in progs.iter_mut() {
                for _ in 0..5 {
                    let t = Instant::now();
                    b.call(*id, &[("x", &x), ("y", &y)]).unwrap();
                    v.push(t.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
        for (on, _, _, v) in progs.iter_mut() {
            v.sort_by(f64::total_cmp);
            println!("{name} cheap_remat={on} median {:.2} ms", v[v.len() / 2]);
        }
    }
}
