"""Training: the time split, training loops, metrics and the model-repository writer."""
