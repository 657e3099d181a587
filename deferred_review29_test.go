package idempotency_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A deferred constraint trigger of the handler's table whose function is
// written in C (here the built-in suppress_redundant_updates_trigger, which
// refuses an INSERT with 39P01) raises at COMMIT an error without a
// context (no Where). commitFailed only takes an error with a context for
// a trigger's, so this one falls through to finishFailed: "unexpected
// database error", OutcomeMisconfigured, Internal. A consumer does not
// count that as the handler's failure, so the message is redelivered
// forever. Expected: the handler's failure, code Unknown, OutcomeReleased,
// nothing stored.
func TestDeferredTriggerWithoutFunctionContextIsTheHandlersFailure(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `
CREATE TABLE audited (id text NOT NULL);
CREATE CONSTRAINT TRIGGER audited_c AFTER INSERT ON audited DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION suppress_redundant_updates_trigger()`)
	require.NoError(t, err)
	o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "audited", ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO audited VALUES ('a-1')`)
		return err
	})
	require.Error(t, err)
	require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
	require.False(t, idempotency.IsFinal(err))
	require.Equal(t, codes.Unknown, status.Code(err), "%v", err)
	require.Zero(t, keyCount(t, db), "nothing stored")
}

// A deferred constraint trigger whose function's statement fails at COMMIT
// with an integrity violation (its INSERT into another table hits that
// table's unique key, or a NOT NULL column) is "a failing statement in the
// trigger's function": the handler's failure, Unknown, nothing stored.
// commitFailed tests the SQLSTATE class 23 before the error's context, so
// it takes these for a deferred constraint of the handler's own rows:
// stored as a final FailedPrecondition, and every later delivery of the
// message is dead-lettered, even once the trigger's statement can pass
// (the conflicting audit row deleted). The same for a RAISE of the
// trigger's with ERRCODE unique_violation.
func TestDeferredTriggerStatementViolationIsNotStored(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, body string }{
		{"unique", `INSERT INTO audit_log VALUES ('fixed', NEW.id)`},
		{"not_null", `INSERT INTO audit_log VALUES (NULL, NEW.id)`},
		{"raise_unique", `RAISE EXCEPTION 'item % is already audited', NEW.id USING ERRCODE = 'unique_violation'`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			db := testdb.New(t, 4)
			store := migratedStore(t, db)
			ctx := context.Background()
			_, err := db.Pool.Exec(ctx, `
CREATE TABLE audit_log (entry text PRIMARY KEY, item text);
INSERT INTO audit_log VALUES ('fixed', 'before');
CREATE TABLE items (id text NOT NULL);
CREATE FUNCTION items_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	`+tc.body+`;
	RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER items_audit AFTER INSERT ON items DEFERRABLE INITIALLY DEFERRED
	FOR EACH ROW EXECUTE FUNCTION items_audit()`)
			require.NoError(t, err)
			o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "items", ID: "m-1"}, func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO items VALUES ('i-1')`)
				return err
			})
			require.Error(t, err)
			require.False(t, idempotency.IsFinal(err), "stored as final: %v", err)
			require.Equal(t, idempotency.OutcomeReleased, o, "%v", err)
			require.Equal(t, codes.Unknown, status.Code(err), "%v", err)
			require.Zero(t, keyCount(t, db), "nothing stored")
		})
	}
}
