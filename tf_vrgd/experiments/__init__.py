"""The application above the `tf_vrgd` library: `vrgd-train` (Model Garden
experiments, resumable, with `--compare`: Fashion-MNIST, and the paper's
BERT, ResNet and DLRM tasks from their files or synthetic inputs, on one
machine or several), the offline data pipelines, the models, the step-cost
and throughput benchmarks, and the switching between an optimizer type and
its VR twin.

Installed with the `experiments` extra (`pip install ".[experiments]"`:
tensorflow-datasets and matplotlib besides the library's dependencies). It
uses only the library's public API.
"""
