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

// It failed when only an error with a context (Where) was taken for a
// deferred trigger's: a trigger function written in C (here the built-in
// suppress_redundant_updates_trigger, refusing an INSERT with 39P01) fails
// at COMMIT without one, and the call was reported as a misconfigured
// store, Internal, and redelivered forever by a consumer. Any error of the
// COMMIT that is not the server's condition is the handler's failure.
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

// It failed when class 23 was tested before the error's context: a
// deferred trigger whose own statement hit a unique key or a NOT NULL
// column (or that raised unique_violation) was taken for a deferred
// constraint of the handler's rows, stored as final, and the message
// dead-lettered even once the trigger could pass.
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
