//! Matrix products of the host ops, with the `gemm` crate (the one Flex multiplies with) on the
//! calling thread.

/// `dst[m × n] = lhs[m × k] · rhs[k × n]` with the `gemm` crate on the calling thread; each
/// operand is given by its pointer, column stride and row stride (in elements).
///
/// # Safety
/// Every element the strides address must lie in its allocation, and `dst` must not overlap
/// `lhs` or `rhs`.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_into(
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize, isize),
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
) {
    // SAFETY: forwarded from the caller.
    unsafe { matmul_add(false, [m, n, k], dst, lhs, rhs) }
}

/// [`matmul_into`], adding the product to `dst`'s contents when `accumulate` is true.
///
/// # Safety
/// As [`matmul_into`].
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn matmul_add(
    accumulate: bool,
    [m, n, k]: [usize; 3],
    dst: (*mut f32, isize, isize),
    lhs: (*const f32, isize, isize),
    rhs: (*const f32, isize, isize),
) {
    // SAFETY: forwarded from the caller; without `accumulate` (gemm's `read_dst`), dst's old
    // contents are ignored.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.0,
            dst.1,
            dst.2,
            accumulate,
            lhs.0,
            lhs.1,
            lhs.2,
            rhs.0,
            rhs.1,
            rhs.2,
            1.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}
