"""Raw public session datasets -> the GRU4Rec text format (spec §1.9).

:mod:`.steps` holds the pure steps on frames, :mod:`.raw` the chunked and validated CSV reading,
and one module per dataset its raw format and pipeline. The entry point is
:func:`recforge.data.sessions.preprocess.prepare` (and its command line).
"""
