-- depends: lines, files
--
-- `log`: every line with its file's path and format, the convenient way to read logs.
--
-- ```sql
-- SELECT path, line_no, ts, rank, level, message FROM log
-- WHERE level IN ('ERROR', 'FATAL') ORDER BY ts LIMIT 50;
-- ```
CREATE OR REPLACE VIEW log AS
SELECT f.path, f.format, l.*
-- a stored-once column's hidden storage (`_message`, docs/schema.md) is not a column to read
FROM (SELECT COLUMNS(lambda c: NOT starts_with(c, '_')) FROM lines) l JOIN files f USING (file_id);
