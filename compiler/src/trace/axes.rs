//! Axis arguments: `x.sum(1, true)`, `x.sum([0, 2], false)`, `x.mean(-1, true)`, `x.sum(.., false)`.

/// Something that names axes of a tensor; negative axes count from the end.
pub trait IntoAxes {
    /// The axes as given (possibly negative); `None` means every axis.
    fn axes(self) -> Option<Vec<isize>>;
}

impl IntoAxes for std::ops::RangeFull {
    fn axes(self) -> Option<Vec<isize>> {
        None
    }
}

macro_rules! int_axes {
    ($($t:ty),*) => {$(
        impl IntoAxes for $t {
            fn axes(self) -> Option<Vec<isize>> { Some(vec![self as isize]) }
        }
        impl<const N: usize> IntoAxes for [$t; N] {
            fn axes(self) -> Option<Vec<isize>> { Some(self.iter().map(|&a| a as isize).collect()) }
        }
        impl IntoAxes for &[$t] {
            fn axes(self) -> Option<Vec<isize>> { Some(self.iter().map(|&a| a as isize).collect()) }
        }
        impl IntoAxes for Vec<$t> {
            fn axes(self) -> Option<Vec<isize>> { Some(self.iter().map(|&a| a as isize).collect()) }
        }
    )*};
}
int_axes!(i32, i64, isize, usize);
