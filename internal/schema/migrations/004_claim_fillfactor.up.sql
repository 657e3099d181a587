-- Since this version a key's row is written twice in its call's transaction:
-- the claim, as the call begins, then the call's result over it. Room kept
-- free in each page (a tenth) lets the second write nearly always be a
-- heap-only update on the same page, which adds no index entries and leaves
-- a dead version that the page's next visitor prunes. It applies to pages
-- filled from now on; no row moves.
ALTER TABLE {{table}} SET (fillfactor = 90);
