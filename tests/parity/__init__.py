"""The parity search: seeded random cases, token-exact against transformers and against the engine itself.

``test_vs_transformers`` and ``test_vs_itself`` run 104 cases each by default (``--parity-cases``; 200 before),
``test_sampling_distribution`` one chi-square test of 20,000 seeded draws; how to run it longer, or
on a GPU in bf16, is in docs/testing.md. Measured on the shared 2-core CPU machine (load average
about 9): the whole directory in 190 s (74 s of CPU), of which 55 s against transformers, 91 s
against itself (its 7 tensor-parallel and Triton-interpreter cases take about 50 s), 42 s sampling.
"""
