"""Line formats: what the text splitter (:mod:`forensics.parsers.text`) runs over every line.

Each module here recognises one family of prefixes or headers on the ``message`` of the
``lines`` frame (Ray's, torchrun's, NCCL's, glog's, vLLM's, the kernel's, Python
logging's, verl's metrics), fills the provenance columns, strips what it recognised and may
emit rows of tables of its own. The helpers they share are in :mod:`.common`, which
imports none of them.
"""
