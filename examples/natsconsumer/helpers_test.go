package natsconsumer_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/natsconsumer"
	"github.com/exactlyonce/idempotency/internal/dburl"
	"github.com/exactlyonce/idempotency/internal/leakcheck"
)

// The tests need a real PostgreSQL and a real nats-server with JetStream.
// Both are named by environment variables with local defaults (the
// database's is dburl's, as for every program here); either one missing
// fails the tests, it never skips them. `bash scripts/test.sh` at the
// repository root starts both when they are installed but down.
const (
	natsURLEnv     = "NATS_URL"
	defaultNATSURL = "nats://127.0.0.1:4222"
)

// TestMain fails the tests if a goroutine outlived them.
func TestMain(m *testing.M) { os.Exit(leakcheck.Run(m)) }

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

func randomName(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return prefix + hex.EncodeToString(b[:])
}

// newDB gives t its own schema and a pool whose search_path is that schema,
// with the idempotency store migrated and the credit tables created. Both
// are removed when t ends.
func newDB(t *testing.T, opts ...idempotency.StoreOption) (*pgxpool.Pool, *idempotency.Store) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	url := dburl.URL()
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatalf("no PostgreSQL at %s: %v\nSet %s to a database these tests may create schemas in, "+
			"or run `bash scripts/test.sh` at the repository root, which starts the local server.", dburl.Redacted(url), err, dburl.EnvVar)
	}
	defer admin.Close(context.Background())
	schema := randomName("natsconsumer_")
	_, err = admin.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	t.Cleanup(func() {
		conn, err := pgx.Connect(context.Background(), url)
		if err == nil {
			_, err = conn.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
			conn.Close(context.Background())
		}
		if err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})

	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	store, err := idempotency.NewStore(pool, opts...)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(ctx))
	require.NoError(t, natsconsumer.CreateCreditTables(ctx, pool))
	return pool, store
}

// connect opens a NATS connection that is closed when t ends.
func connect(t *testing.T) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	url := envOr(natsURLEnv, defaultNATSURL)
	nc, err := nats.Connect(url, nats.Timeout(5*time.Second))
	if err != nil {
		t.Fatalf("no NATS at %s: %v\nSet %s to a nats-server with JetStream (-js), "+
			"or run `bash scripts/test.sh` at the repository root, which starts the local one.", url, err, natsURLEnv)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	require.NoError(t, err)
	return nc, js
}

// newStream creates a stream with a name of its own, and a durable pull
// consumer on it with the given AckWait; both are deleted when t ends. It
// returns the stream's subject.
func newStream(t *testing.T, js jetstream.JetStream, duplicates, ackWait time.Duration) (stream, durable, subject string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, durable = randomName("CREDITS_"), randomName("applier_")
	subject = stream + ".credits"
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: duplicates})
	require.NoError(t, err, "create stream (is JetStream enabled on the server? nats-server -js)")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := js.DeleteStream(ctx, stream); err != nil {
			t.Errorf("delete stream %s: %v", stream, err)
		}
	})
	_, err = js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
		Durable:   durable,
		AckPolicy: jetstream.AckExplicitPolicy,
		AckWait:   ackWait,
	})
	require.NoError(t, err)
	return stream, durable, subject
}

// newConsumer returns a Consumer on the durable, on its own connection js.
func newConsumer(t *testing.T, js jetstream.JetStream, store *idempotency.Store, stream, durable string, h natsconsumer.Handler, opts ...natsconsumer.Option) *natsconsumer.Consumer {
	t.Helper()
	cons, err := js.Consumer(context.Background(), stream, durable)
	require.NoError(t, err)
	c, err := natsconsumer.New(store, cons, h, opts...)
	require.NoError(t, err)
	return c
}

// start runs c until the returned stop is called (or t ends) and returns
// what Run returned.
func start(t *testing.T, ctx context.Context, c *natsconsumer.Consumer) (stop func() error) {
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(10 * time.Second):
				err = fmt.Errorf("Run did not return within 10s of cancellation")
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// publish publishes a credit with id as its Nats-Msg-Id.
func publish(t *testing.T, js jetstream.JetStream, subject, id string, c natsconsumer.Credit) *jetstream.PubAck {
	t.Helper()
	body, err := json.Marshal(c)
	require.NoError(t, err)
	ack, err := natsconsumer.Publish(context.Background(), js, subject, id, body)
	require.NoError(t, err)
	return ack
}

// tally records every delivery the consumers of one test report.
type tally struct {
	mu         sync.Mutex
	deliveries []natsconsumer.Delivery
}

func (tl *tally) record(d natsconsumer.Delivery) {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.deliveries = append(tl.deliveries, d)
}

func (tl *tally) hook() natsconsumer.Option { return natsconsumer.WithOutcomeHook(tl.record) }

func (tl *tally) all() []natsconsumer.Delivery {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	return append([]natsconsumer.Delivery(nil), tl.deliveries...)
}

func (tl *tally) count(o natsconsumer.Outcome) int {
	n := 0
	for _, d := range tl.all() {
		if d.Outcome == o {
			n++
		}
	}
	return n
}

func (tl *tally) of(id string) []natsconsumer.Delivery {
	var ds []natsconsumer.Delivery
	for _, d := range tl.all() {
		if d.ID == id {
			ds = append(ds, d)
		}
	}
	return ds
}

func (tl *tally) redeliveries() int {
	n := 0
	for _, d := range tl.all() {
		if d.NumDelivered > 1 {
			n++
		}
	}
	return n
}

func (tl *tally) String() string {
	return fmt.Sprintf("%d deliveries (%d redeliveries): %d applied, %d duplicates, %d in progress, %d retried, %d rejected, %d given up",
		len(tl.all()), tl.redeliveries(), tl.count(natsconsumer.Applied), tl.count(natsconsumer.Duplicate),
		tl.count(natsconsumer.InProgress), tl.count(natsconsumer.Retried), tl.count(natsconsumer.Rejected), tl.count(natsconsumer.GaveUp))
}

// waitAcked waits until the durable has acknowledged (or terminated) every
// message up to stream sequence last, and until done is true.
func waitAcked(t *testing.T, js jetstream.JetStream, stream, durable string, last uint64, done func() bool) {
	t.Helper()
	cons, err := js.Consumer(context.Background(), stream, durable)
	require.NoError(t, err)
	waitConsumerAcked(t, cons, last, done)
}

// waitConsumerAcked is waitAcked for a consumer in hand, durable or not.
func waitConsumerAcked(t *testing.T, cons jetstream.Consumer, last uint64, done func() bool) {
	t.Helper()
	require.Eventually(t, func() bool {
		info, err := cons.Info(context.Background())
		return err == nil && info.AckFloor.Stream >= last && info.NumAckPending == 0 && done()
	}, 20*time.Second, 20*time.Millisecond, "messages not all acknowledged")
}

// requireAppliedOnce checks the business tables: exactly one credit row per
// message ID in want, and each balance the sum of its credits.
func requireAppliedOnce(t *testing.T, pool *pgxpool.Pool, want map[string]natsconsumer.Credit) {
	t.Helper()
	ctx := context.Background()
	got := map[string]int{}
	var id string
	var n int
	rows, err := pool.Query(ctx, `SELECT msg_id, count(*)::int FROM account_credits GROUP BY msg_id`)
	require.NoError(t, err)
	_, err = pgx.ForEachRow(rows, []any{&id, &n}, func() error {
		got[id] = n
		return nil
	})
	require.NoError(t, err)
	wantRows := map[string]int{}
	wantBalances := map[string]int64{}
	for id, c := range want {
		wantRows[id] = 1
		wantBalances[c.Account] += c.AmountCents
	}
	require.Equal(t, wantRows, got, "credit rows per message ID")

	rows, err = pool.Query(ctx, `SELECT account_id, balance_cents FROM account_balances`)
	require.NoError(t, err)
	gotBalances := map[string]int64{}
	var account string
	var balance int64
	_, err = pgx.ForEachRow(rows, []any{&account, &balance}, func() error {
		gotBalances[account] = balance
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, wantBalances, gotBalances, "balances")
}
