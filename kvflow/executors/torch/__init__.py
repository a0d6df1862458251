"""The torch executor: real copies between device KV tensors and a pinned host pool.

- ``executor``: ``TorchExecutor`` (submit, poll, close); ``ranks``: ``RankGroup``, one worker
  process per rank; ``result_channel``: each result once, to ``poll``;
- ``host_pool``: the pinned host pool, sized once; ``layout``: the device KV layout;
- ``transfer_plan``: a job's device blocks and slots as contiguous runs;
- ``streams``: copy streams and the compute-done event; ``npu``: what differs on Ascend NPUs;
- the copy paths: ``copy_setup`` (the chooser), ``page_copies``, ``staged_copies``,
  ``batch_copy``, ``uva``, ``page_kernel``.

May import: ``kvflow.core`` and torch.
"""
