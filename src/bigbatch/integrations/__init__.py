"""Integrations of the bigbatch engine into the training loops users already run."""
