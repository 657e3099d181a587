ALTER TABLE {{table}} RESET (fillfactor);
