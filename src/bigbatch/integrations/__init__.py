"""Running bigbatch's exact GradCache step inside the training loops users already have.

Each integration is its own module, imported only when asked for, so that ``import bigbatch``
never imports sentence-transformers, transformers or accelerate:

- :mod:`bigbatch.integrations.sentence_transformers`: :class:`CachedInfoNCELoss`, a loss for
  ``SentenceTransformerTrainer`` used as ``CachedMultipleNegativesRankingLoss`` is;
- :mod:`bigbatch.integrations.hf`: :class:`GradCacheTrainer`, a ``transformers.Trainer``
  whose training step is a bigbatch step;
- :mod:`bigbatch.integrations.deferred`: :func:`gradcache_loss`, the step as a loss tensor to
  call ``backward()`` (or ``accelerator.backward``) on, which the two above are built on and
  an ``accelerate`` loop uses directly;
- :mod:`bigbatch.integrations.deepspeed`: the step under DeepSpeed ZeRO 1/2/3 with one gradient
  reduction per step (``deepspeed_cache``, ``deepspeed_step``; ``bigbatch train --deepspeed``).

Guide: ``docs/guides/integrations.md``.
"""
