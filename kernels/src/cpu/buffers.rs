//! The f32 working buffers of the half kernels (`per_image`'s groups of widened images, a fused
//! product's row-block tile, a half reduction's or gradient's f32 sums, widened gradients): one set per
//! thread, shared by every kernel, since a plan's steps run one at a time. What stays allocated
//! is then the largest single need, not the sum over a plan's kernels: each kernel keeping its
//! own took 80.6 MB for the zoo cnn's 13 convolution and pooling kernels (peak RSS 123 MB against
//! 56 MB with every op widened).

use std::cell::RefCell;

/// The buffers of one thread, by use.
#[derive(Default)]
pub(crate) struct Buffers {
    /// Widened images: a group's operands and half output (`per_image`), an image of x for a
    /// grouped filter gradient (`grouped_conv`).
    pub(crate) images: Vec<f32>,
    /// A fused product's row-block tile (`fused`).
    pub(crate) tile: Vec<f32>,
    /// f32 sums of a half output: a reduction's, a filter gradient's, a gather gradient's
    /// column block (`fused`, `conv`, `gather`).
    pub(crate) sums: Vec<f32>,
    /// A widened gradient: an image of dy (`grouped_conv`), a row segment of dy (`gather`).
    pub(crate) gradients: Vec<f32>,
}

thread_local! {
    static BUFFERS: RefCell<Buffers> = RefCell::new(Buffers::default());
}

/// `f` with the calling thread's buffers; with fresh ones where the thread's are in use (a
/// kernel run inside another's on this thread: a rayon task it waits for).
pub(crate) fn with<R>(f: impl FnOnce(&mut Buffers) -> R) -> R {
    BUFFERS.with(|cell| match cell.try_borrow_mut() {
        Ok(mut buffers) => f(&mut buffers),
        Err(_) => f(&mut Buffers::default()),
    })
}
