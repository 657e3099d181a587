package idempotency

import "testing"

func TestUnitTxControlFindsStatementsThatEndTheTransaction(t *testing.T) {
	refused := map[string]string{
		"COMMIT":                                                  "COMMIT",
		"commit and chain":                                        "COMMIT",
		"  End Work":                                              "END",
		"abort":                                                   "ABORT",
		"ROLLBACK":                                                "ROLLBACK",
		"rollback and chain":                                      "ROLLBACK",
		"ROLLBACK PREPARED 'x'":                                   "ROLLBACK PREPARED",
		"COMMIT PREPARED 'x'":                                     "COMMIT",
		"BEGIN":                                                   "BEGIN",
		"begin isolation level serializable":                      "BEGIN",
		"START TRANSACTION":                                       "START TRANSACTION",
		"PREPARE TRANSACTION 'x'":                                 "PREPARE TRANSACTION",
		"INSERT INTO t VALUES (1); COMMIT":                        "COMMIT",
		"INSERT INTO t VALUES (1);COMMIT;BEGIN":                   "COMMIT",
		"insert into t values ('a;b'); commit":                    "COMMIT",
		"SELECT 1; -- a comment\nCOMMIT":                          "COMMIT",
		"/* a /* nested */ comment */ COMMIT":                     "COMMIT",
		"SELECT $$;$$; COMMIT":                                    "COMMIT",
		"SELECT $tag$ $$; $tag$; COMMIT":                          "COMMIT",
		`SELECT E'\';'; COMMIT`:                                   "COMMIT",
		`SELECT "a;b" FROM t; COMMIT`:                             "COMMIT",
		"SET TRANSACTION READ ONLY":                               "SET TRANSACTION",
		"SET LOCAL TRANSACTION ISOLATION LEVEL SERIALIZABLE":      "SET TRANSACTION",
		"set session characteristics as transaction read only":    "SET SESSION CHARACTERISTICS",
		"SET transaction_read_only = on":                          "SET transaction_read_only",
		"SET LOCAL default_transaction_isolation TO serializable": "SET default_transaction_isolation",
		`SET "transaction_isolation" = 'serializable'`:            "SET transaction_isolation",
	}
	for sql, want := range refused {
		if got, _ := txControl(sql); got != want {
			t.Errorf("txControl(%q) = %q, want %q", sql, got, want)
		}
	}
	for _, sql := range []string{
		"",
		"SELECT 1",
		"INSERT INTO ledger (note) VALUES ('COMMIT')",
		"INSERT INTO ledger (note) VALUES ('x; COMMIT')",
		"SELECT $$; COMMIT $$",
		"SELECT $1::text; SELECT 2",
		`SELECT E'it''s; commit'`,
		"SELECT 1 -- ; COMMIT",
		"SELECT 1 /* ; COMMIT */",
		`SELECT "; COMMIT" FROM t`,
		"UPDATE t SET ended = true WHERE type = 'begin'",
		"SELECT CASE WHEN true THEN 1 END",
		"SAVEPOINT mine",
		"ROLLBACK TO SAVEPOINT mine",
		"ROLLBACK TO mine",
		"RELEASE SAVEPOINT mine",
		// Any name: the engine's own savepoint has one no handler knows.
		"SAVEPOINT idempotency_call",
		`SAVEPOINT U&"idempotency_call"`,
		"RELEASE idempotency_sp_1",
		`ROLLBACK TO "idempotency_sp_1"`,
		"SET LOCAL search_path = tenant_1",
		"SET search_path TO tenant_1, public",
		"SET TIME ZONE 'UTC'",
		"SET LOCAL transaction_timeout = '5s'",
		"SET LOCAL statement_timeout = 1000",
		"PREPARE q AS SELECT 1",
		"DO $$ BEGIN PERFORM 1; END $$",
		"WITH x AS (SELECT 1) SELECT * FROM x",
		"(SELECT 1)",
		"typecommit",
		"CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END",
		"CREATE OR REPLACE PROCEDURE p() LANGUAGE sql BEGIN ATOMIC INSERT INTO t VALUES (CASE WHEN true THEN 1 END); SELECT 2; END",
		"CREATE FUNCTION f() RETURNS int LANGUAGE plpgsql AS $$ BEGIN COMMIT; END $$",
	} {
		if got, _ := txControl(sql); got != "" {
			t.Errorf("txControl(%q) = %q, want none", sql, got)
		}
	}
}

// A single word that starts no SQL statement may be the name of a prepared
// statement, which pgx runs when given its name: the caller checks it.
func TestUnitTxControlNamesPreparedStatements(t *testing.T) {
	for sql, name := range map[string]string{"finish_batch": "finish_batch", " stmt_1 ": " stmt_1 ", "commit": "", "select": "", "SELECT 1": "", "a b": ""} {
		if _, got := txControl(sql); got != name {
			t.Errorf("txControl(%q) names prepared statement %q, want %q", sql, got, name)
		}
	}
}

func FuzzTxControl(f *testing.F) {
	for _, s := range []string{"COMMIT", "SELECT 'a'; COMMIT", "SELECT $a$ x $a$", "/* /* */", "E'\\'", `"x""y"`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, sql string) {
		txControl(sql) // must terminate without panicking on any input
	})
}

// Ways past the check that once got through, now caught: a CREATE FUNCTION
// whose name is begin (not a BEGIN ATOMIC body), and statement names that
// are not one word.
func TestUnitTxControlCatchesWhatGotPast(t *testing.T) {
	if got, _ := txControl("CREATE FUNCTION begin() RETURNS int LANGUAGE sql AS 'SELECT 1'; COMMIT"); got != "COMMIT" {
		t.Errorf("a function named begin hid the COMMIT after it: %q", got)
	}
	if got, _ := txControl("CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; END; COMMIT"); got != "COMMIT" {
		t.Errorf("COMMIT after a BEGIN ATOMIC body: %q", got)
	}
	for _, name := range []string{"finish-batch", "stmt.1", "a:b"} {
		if _, got := txControl(name); got != name {
			t.Errorf("txControl(%q) names prepared statement %q", name, got)
		}
	}
}
