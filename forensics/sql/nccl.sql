-- depends: nccl_comms, nccl_colls
--
-- `nccl_rank_map`: which rank each process holds, from NCCL communicator lines. One row per
-- (host, pid) as printed in the NCCL header: `rank` is its rank in its largest communicator
-- (the world communicator in the usual layout), `ranks` all ranks it holds, `nodes` the node
-- names its lines carry (NCCL host, Ray `ip=`, folder). Join other evidence on `pid` (and
-- `node` in `nodes` or `= host` when the node is known) to learn a process's rank.
--
-- `nccl_collectives`: the per-collective lines (NCCL_DEBUG_SUBSYS=COLL) with the rank filled
-- from the communicator lines of any file, the communicator's `comm_id`, and `call_no`, the
-- 1-based position of the call among the calls of that communicator in that file.
--
-- ```sql
-- SELECT host, pid, rank, nranks, nccl_version FROM nccl_rank_map ORDER BY rank;
-- -- how many collectives each rank issued per communicator
-- SELECT rank, comm_id, count(*) AS calls, arg_max(op, call_no) AS last_op
-- FROM nccl_collectives GROUP BY ALL ORDER BY rank;
-- ```
CREATE OR REPLACE VIEW nccl_rank_map AS
SELECT
    host,
    pid,
    arg_max(rank, nranks) AS rank,
    max(nranks) AS nranks,
    list(DISTINCT rank ORDER BY rank) AS ranks,
    list(DISTINCT node ORDER BY node) FILTER (WHERE node IS NOT NULL) AS nodes,
    count(DISTINCT comm) AS communicators,
    arg_max(cuda_dev, nranks) AS cuda_dev,
    max(nccl_version) AS nccl_version,
    min(file_id) AS file_id,
    min(line_no) AS line_no
FROM nccl_comms
WHERE rank IS NOT NULL AND pid IS NOT NULL AND host IS NOT NULL
GROUP BY host, pid;

CREATE OR REPLACE VIEW nccl_collectives AS
WITH comm_info AS (
    SELECT host, pid, comm, max(comm_id) AS comm_id, arg_max(rank, line_no) AS comm_rank, max(nranks) AS comm_nranks
    FROM nccl_comms
    WHERE comm IS NOT NULL
    GROUP BY host, pid, comm
)
SELECT
    c.file_id,
    c.line_no,
    c.ts,
    c.node,
    c.host,
    c.pid,
    c.tid,
    coalesce(c.rank, i.comm_rank) AS rank,
    c.comm,
    i.comm_id,
    coalesce(c.nranks, i.comm_nranks) AS nranks,
    row_number() OVER (PARTITION BY c.file_id, c.host, c.pid, c.comm ORDER BY c.line_no) AS call_no,
    c.op,
    c.op_count,
    c.count,
    c.dtype,
    c.redop,
    c.root,
    c.stream
FROM nccl_colls c
LEFT JOIN comm_info i USING (host, pid, comm);
