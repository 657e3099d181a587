package idempotency_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// BenchmarkFreshCall is a fresh call of the engine alone, one at a time,
// beside the floor of a durable key (the same handler in its own
// transaction, plus the key's row sent with the COMMIT): what Go spends per
// call, allocations included. Run with
//
//	go test -run '^$' -bench FreshCall -benchmem .
func BenchmarkFreshCall(b *testing.B) {
	db := testdb.New(b, 2)
	ctx := context.Background()
	store := migratedStore(b, db)
	createLedger(b, db)
	write := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return writeLedger(ctx, tx) }
	insert := `INSERT INTO ` + pgx.Identifier{db.Schema, idempotency.DefaultTable}.Sanitize() + ` (scope, key, method, fingerprint, state, response_type, response, expires_at)
VALUES ($1, $2, $3, $4, 'succeeded', $5, $6, now() + interval '1 day')`
	n := 0
	b.Run("floor", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			n++
			if err := floorCall(ctx, db, insert, "floor-"+strconv.Itoa(n)); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("execute", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			n++
			res, err := store.Execute(ctx, idempotency.Call{Key: "k-" + strconv.Itoa(n), Method: "m"}, write)
			if err != nil || res.Outcome != idempotency.OutcomeExecuted {
				b.Fatal(res.Outcome, err)
			}
		}
	})
}

// floorCall is the floor of a durable key, as the load tool measures it:
// BEGIN, the handler, then the key's row and the COMMIT in one round trip.
func floorCall(ctx context.Context, db *testdb.DB, insert, key string) error {
	pc, err := db.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer pc.Release()
	if _, err := pc.Exec(ctx, "BEGIN"); err != nil {
		return err
	}
	resp, err := writeLedger(ctx, pc.Conn())
	if err != nil {
		_, _ = pc.Exec(ctx, "ROLLBACK")
		return err
	}
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
	if err != nil {
		return err
	}
	batch := &pgx.Batch{}
	batch.Queue(insert, "", key, "m", []byte{}, "google.protobuf.StringValue", body)
	batch.Queue("COMMIT")
	return pc.SendBatch(ctx, batch).Close()
}

// writeLedger is the benchmarks' handler: one ledger row, and its id.
func writeLedger(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) (proto.Message, error) {
	var id int64
	err := q.QueryRow(ctx, `INSERT INTO ledger (note) VALUES ('x') RETURNING id`).Scan(&id)
	return wrapperspb.String(strconv.FormatInt(id, 10)), err
}
