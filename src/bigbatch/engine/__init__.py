"""The engine: one optimizer step whose gradients equal the full batch's (GradCache),
its chunking, random-state replay, cross-rank step and the loss contract. It imports no
loss."""
