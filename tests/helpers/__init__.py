"""Shared test helpers, imported as `helpers.<module>` (tests/conftest.py puts tests/ on sys.path).

- `dist_pool`: the gloo process pool behind the `gloo` fixture.
- `reference`, `packs`: the per-document parity reference and named pack layouts.
- `parity`: the dense parity case (`parity_case`), its families and tolerance.
- `bf16_parity`: the bf16 criterion of the GPU tests (errors compared with the stock bf16 model's)
  and the CP step they measure.
- `layouts`: packs, layouts and hypothesis strategies of the planning tests.
- `model_zoo`, `model_packs`: tiny configs of every covered model family and their packs.
- `kernel_inputs`: random q/k/v over a planned layout for the kernel feature tests.
- `data`: random document lengths for the sampler and data-distribution tests.
- `trainer`: the tiny Llama the Trainer tests train.
"""
