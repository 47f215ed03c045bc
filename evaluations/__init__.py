"""Sample-quality evaluation: the ADM suite (Inception Score, FID, sFID, precision, recall) on a
PyTorch port of the 2015-12-05 FID Inception graph, and a small digits classifier that stands in
for Inception on the embedded digits dataset.

Modules: metrics (the numbers), inception (the network), inception_weights (finding, checking and loading its
weights), inception_torchscript (NVlabs' TorchScript weights mapped onto it), features (image/feature batching),
evaluator (ADM CLI and `evaluate`), digits_classifier (toy-scale feature network).
"""
