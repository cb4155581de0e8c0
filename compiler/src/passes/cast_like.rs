use super::{Changes, Pass};
use crate::autocast::cast_node;
use crate::error::Result;
use crate::ir::{DType, Graph, NodeId, Op};

/// Makes every `Op::CastLike` (value, like) what it is once the types are known: nothing where
/// they share one (every f32 graph), a `Cast` to like's type otherwise. Mixed precision resolves
/// them first (`autocast`), rounding a layer's output to half where its input is stored in half;
/// this pass is for the graphs that never pass through it (an imported model compiled as it
/// is), so that no plan runs a copy for one.
pub struct ResolveCastLike;

impl Pass for ResolveCastLike {
    fn name(&self) -> &'static str {
        "resolve_cast_like"
    }

    fn run(&self, graph: &mut Graph) -> Result<Changes> {
        Ok(Changes::count(resolve(graph, None)))
    }
}

/// Resolves every `Op::CastLike` of `graph`; the number resolved. With `half` (mixed precision,
/// after `autocast` rounded its products), one whose `like` is a half value read widened (a
/// `Cast` to f32 of a `half` value, through reshapes and transposes) rounds its value to `half`
/// and is read widened in turn, as a product is; the others are a `Cast` or nothing.
pub(crate) fn resolve(graph: &mut Graph, half: Option<DType>) -> usize {
    let found: Vec<NodeId> = graph.node_ids().filter(|&n| graph.node(n).op == Op::CastLike).collect();
    for &n in &found {
        let (value, like) = match graph.operands(n)[..] {
            [v, l] => (v, l),
            _ => continue,
        };
        let to = match half {
            Some(h) if stored_in(graph, like) == Some(h) => Some(h),
            _ => None,
        };
        let d = graph.node(value).dtype;
        let result = match to {
            Some(h) if d != h => {
                let narrow = cast_node(graph, value, h);
                cast_node(graph, narrow, d)
            }
            Some(_) => value,
            None if d == graph.node(n).dtype => value,
            None => {
                let to = graph.node(n).dtype;
                cast_node(graph, value, to)
            }
        };
        graph.replace_uses(n, result);
        graph.remove(n);
    }
    found.len()
}

/// The type `x` is stored in: a `Cast` to f32 of a value (through reshapes and transposes)
/// reads that value widened, so it is stored in that value's type.
fn stored_in(graph: &Graph, mut x: NodeId) -> Option<DType> {
    loop {
        match graph.node(x).op {
            Op::Reshape { .. } | Op::Permute { .. } => x = *graph.operands(x).first()?,
            Op::Cast { to: DType::F32 } => return graph.operands(x).first().map(|&h| graph.node(h).dtype),
            _ => return Some(graph.node(x).dtype),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::Tracer;

    /// An f32 graph's cast_like is nothing; one to another type is a cast; under mixed precision
    /// one like a half value read widened rounds its value to half and reads it widened.
    #[test]
    fn cast_like_resolves_to_nothing_a_cast_or_a_rounding() {
        let t = Tracer::new("cast_like");
        let x = t.input("x", [2, 3]);
        let h = t.input("h", [2, 3]).cast(DType::BF16);
        let y = x.exp();
        t.output("same", &y.cast_like(&x));
        t.output("other", &y.cast_like(&h));
        t.output("rounded", &y.cast_like(&h.cast(DType::F32)));
        let g = t.finish().unwrap();
        let mut plain = g.clone();
        assert_eq!(resolve(&mut plain, None), 3);
        let ops = |g: &Graph, name: &str| {
            let mut n = g.output(name).unwrap();
            let mut ops = Vec::new();
            while let Op::Cast { to } = g.node(n).op {
                ops.push(to);
                n = g.operands(n)[0];
            }
            ops
        };
        assert_eq!(ops(&plain, "same"), []);
        assert_eq!(ops(&plain, "other"), [DType::BF16]);
        assert_eq!(ops(&plain, "rounded"), []);
        let mut mixed = g.clone();
        resolve(&mut mixed, Some(DType::BF16));
        assert_eq!(ops(&mixed, "rounded"), [DType::F32, DType::BF16], "read widened after rounding");
        assert_eq!(ops(&mixed, "same"), []);
    }
}
