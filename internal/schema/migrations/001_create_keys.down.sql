-- Removes the key table and everything in it: every stored result is lost,
-- and every key can run again.
DROP TABLE IF EXISTS {{table}};
