"""The trainer side: what runs inside each training process (one per rank), reading shared memory.

`ODBClient` (client) connects to its node's daemon over the step socket (odbclient.connect,
odbclient.framing), and an iterator reads each step's samples out of the daemon's shared-memory
arena (odbclient.shm) into fresh tensors: in a reader thread of the trainer process (stream,
collate, step_collate, inbox, reports), or with reader="process" in a reader process per rank
(`python -m odbclient.trainer.reader_process`, the only other process started here) that hands
batches to the trainer through a control page (staging, staged_stream). The rest is what a
trainer does with a step: Batch (batch), packed rows (packing, packed_check) and the ranks'
agreement on steps and updates over torch.distributed (align, update_align). Nothing here
writes samples; the producer side (odbclient.producer) does.
"""
