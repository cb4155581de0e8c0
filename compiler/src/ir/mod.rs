//! kiln's intermediate representation: typed dataflow graphs of ops.

mod dtype;
mod dump;
pub mod fused;
mod graph;
mod infer;
mod op;
mod shape;

pub use dtype::DType;
pub use dump::dump;
pub use fused::{Fused, FusedMatMul, FusedReduce};
pub use graph::{DeviceId, Edge, Graph, Node, NodeId, SourceLoc};
pub use infer::{MAX_TENSOR_BYTES, OpError, infer};
pub use op::{
    BinaryOp, Grad, Init, Op, OpClass, Padding, PoolKind, ReduceOp, Rows, ScalarOp, Shard, UnaryOp, VarRole,
    Window2d, uniform,
};
pub use shape::Shape;
