"""The application above the `tf_vrgd` library: `vrgd-train` (Model Garden
experiments on Fashion-MNIST, resumable, with `--compare`), the offline data
pipeline, the models of the CPU-scale experiments, the step-cost benchmark,
and the switching between an optimizer type and its VR twin.

Installed with the `experiments` extra (`pip install ".[experiments]"`:
tensorflow-datasets and matplotlib besides the library's dependencies). It
uses only the library's public API.
"""
