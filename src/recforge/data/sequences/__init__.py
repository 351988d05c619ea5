"""User histories for sequential recommenders (SASRec, HSTU).

:mod:`.prepared` is the on-disk format (``histories.parquet``, ``items.parquet``, ``done.json``),
:mod:`.preprocess` turns raw ratings (MovieLens, Amazon) into it, :mod:`.synthetic` generates a
learnable dataset in it, :mod:`.splits` cuts users into training and evaluation rows and
:mod:`.datamodule` serves them as jagged :class:`recforge.data.batches.HistoryBatch` es.
"""
