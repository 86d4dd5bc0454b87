"""The implementation paths behind `attention(..., implementation=...)`, one module each.

Each path module defines its `PATH` (a `jax_mha._path.Path`: name, platforms, the parts
of a call it takes, its limits, its `run`), and `jax_mha._dispatch.REGISTRY` registers
them in `"auto"`'s order. `dense` (whole scores), `blockwise` over `engine` (query and
key blocks, the FlashAttention-2 backward, `linear_map` its transpose), `cudnn`,
`pallas_gpu` and `pallas_tpu` over the library's kernel `flex` (`kernel_mods`: mods on
index tiles; `schedules`: the block schedule), `pallas_mgpu`, and the decode kernels
`pallas_gpu_decode`, `pallas_tpu_decode`. What the kernels share is in
`kernel_common`; no kernel module imports another. Private: call `jax_mha.attention`.
"""
