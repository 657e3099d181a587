package idempotency_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

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

// BenchmarkStep is the price of a recorded step (Step): a payments-like
// handler (an account's balance raised, a ledger row) run by Execute
// without a step and with one, whose work is a trivial function, so that
// what is measured is the step's lookup and its record's commit. 8 callers
// at once on a pool of 12; it reports calls/s, to compare within a round:
//
//	for i in 1 2 3 4 5 6; do go test -run '^$' -bench Step -benchtime 3s -count 1 .; done
func BenchmarkStep(b *testing.B) {
	db := testdb.New(b, 12)
	ctx := context.Background()
	store := migratedStore(b, db)
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL DEFAULT 0);
INSERT INTO accounts (id) SELECT generate_series(0, 63);
CREATE TABLE charges (id bigserial PRIMARY KEY, account int NOT NULL, amount bigint NOT NULL, provider_charge text)`); err != nil {
		b.Fatal(err)
	}
	var seq atomic.Int64
	charge := func(step bool) idempotency.Func {
		return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			n := seq.Add(1)
			providerCharge := ""
			if step {
				v, err := idempotency.Step(ctx, "provider charge", func(ctx context.Context, key string) (*wrapperspb.StringValue, error) {
					return wrapperspb.String("ch_" + key[:12]), nil
				})
				if err != nil {
					return nil, err
				}
				providerCharge = v.GetValue()
			}
			var balance int64
			err := tx.QueryRow(ctx, `WITH c AS (INSERT INTO charges (account, amount, provider_charge) VALUES ($1, 100, $2))
UPDATE accounts SET balance = balance + 100 WHERE id = $1 RETURNING balance`, n%64, providerCharge).Scan(&balance)
			return wrapperspb.Int64(balance), err
		}
	}
	for _, step := range []bool{false, true} {
		name := map[bool]string{false: "without", true: "with"}[step]
		b.Run(name, func(b *testing.B) {
			fn := charge(step)
			start := time.Now()
			b.SetParallelism(4)
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					key := "k-" + strconv.FormatInt(seq.Add(1), 10) + "-" + strconv.FormatInt(start.UnixNano(), 36)
					if _, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m"}, fn); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "calls/s")
		})
	}
}
