//! The geometry of a 2-D window (convolution or pooling) over NHWC tensors, shared by the CPU
//! kernels and the CUDA generator: extents, window, stride and the padding before the first
//! element, as `Window2d::out_and_pad` gives it (TensorFlow's SAME split).

use kiln_compiler::ir::{Shape, Window2d};

#[derive(Clone, Debug)]
pub(crate) struct Geom {
    pub n: usize,
    pub h: usize,
    pub w: usize,
    pub c: usize,
    pub oh: usize,
    pub ow: usize,
    /// Output channels: the filter count of a convolution, the input's channels for pooling.
    pub f: usize,
    pub kh: usize,
    pub kw: usize,
    pub sh: usize,
    pub sw: usize,
    pub ph: usize,
    pub pw: usize,
    /// The dilation: input elements between neighbouring taps (1: dense taps).
    pub dh: usize,
    pub dw: usize,
    /// Channel groups: input channels C/G of group g meet output channels F/G of group g.
    pub groups: usize,
}

impl Geom {
    /// The geometry of `window` over input `x` (NHWC) with `f` output channels. Shapes were
    /// checked by `ir::infer`, so the window fits.
    pub fn new(x: &Shape, window: &Window2d, f: usize) -> Geom {
        let [n, h, w, c] = [0, 1, 2, 3].map(|i| x.dims()[i]);
        let (oh, ph) = window.out_and_pad(0, h).expect("checked by infer");
        let (ow, pw) = window.out_and_pad(1, w).expect("checked by infer");
        let [kh, kw] = window.size;
        let [sh, sw] = window.stride;
        let [dh, dw] = window.dilation;
        Geom { n, h, w, c, oh, ow, f, kh, kw, sh, sw, ph, pw, dh, dw, groups: window.groups }
    }

    /// Whether the window is dense (one group, no dilation): the GEMM-shaped kernels' case.
    pub fn is_dense(&self) -> bool {
        self.groups == 1 && self.dh == 1 && self.dw == 1
    }

    /// Whether the windows cover the input exactly once each element (`Window2d::tiles`): a
    /// pooling gradient may then be written over its input, a window at a time.
    pub fn tiles(&self) -> bool {
        self.sh == self.kh
            && self.sw == self.kw
            && self.dh == 1
            && self.dw == 1
            && self.ph == 0
            && self.pw == 0
            && self.oh * self.kh == self.h
            && self.ow * self.kw == self.w
    }

    /// The same over a pooling input: as many output channels as input channels.
    pub fn pool(x: &Shape, window: &Window2d) -> Geom {
        Geom::new(x, window, x.dims()[3])
    }

    /// "3x3 stride 1x1 pad 1x1, 8x32x32x3 -> 8x32x32x16", for kernel descriptions (a dilation
    /// and a group count other than 1 follow the padding).
    pub fn text(&self) -> String {
        let mut extra = String::new();
        if self.dh != 1 || self.dw != 1 {
            extra += &format!(" dilation {}x{}", self.dh, self.dw);
        }
        if self.groups != 1 {
            extra += &format!(" groups {}", self.groups);
        }
        format!(
            "{}x{} stride {}x{} pad {}x{}{extra}, {}x{}x{}x{} -> {}x{}x{}x{}",
            self.kh,
            self.kw,
            self.sh,
            self.sw,
            self.ph,
            self.pw,
            self.n,
            self.h,
            self.w,
            self.c,
            self.n,
            self.oh,
            self.ow,
            self.f
        )
    }
}
