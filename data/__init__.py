"""Traces recorded on real GPUs (see README.md here): installed with gclab as `gclab.data`."""
