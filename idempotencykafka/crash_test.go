package idempotencykafka_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
	"github.com/exactlyonce/idempotency/internal/crashproc"
)

// The tests run the real franz-go client against kfake, franz-go's
// in-process broker that speaks Kafka's wire protocol (groups, offsets,
// rebalances), and the real PostgreSQL.

// childEnv, when set, makes the test binary a consumer process: a
// childConfig in JSON.
const childEnv = "IDEMPOTENCYKAFKA_CHILD"

type childConfig struct {
	Brokers     []string
	DatabaseURL string
	Group       string
	Topic       string
	InstanceID  string
	// KillAfterExecuted kills the process with SIGKILL right after the
	// n-th record's transaction committed, before its offset is committed.
	KillAfterExecuted int64
}

// runChild consumes until killed, telling stderr of every replay.
func runChild() error {
	var c childConfig
	if err := json.Unmarshal([]byte(os.Getenv(childEnv)), &c); err != nil {
		return fmt.Errorf("%s: %w", childEnv, err)
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, c.DatabaseURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	var executed atomic.Int64
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(endTracer(func(_ context.Context, d idempotency.TraceCallEndData) {
		// After the record's transaction committed, before its offset is.
		if d.Outcome == idempotency.OutcomeExecuted && executed.Add(1) == c.KillAfterExecuted {
			crashproc.KillSelf()
		}
	})))
	if err != nil {
		return err
	}
	client, err := kgo.NewClient(consumerOpts(c.Brokers, c.Group, c.Topic, kgo.InstanceID(c.InstanceID))...)
	if err != nil {
		return err
	}
	defer client.Close()
	consumer, err := idempotencykafka.New(store, client, credit, idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
		if o == idempotency.OutcomeReplayed {
			fmt.Fprintf(os.Stderr, "replayed %s\n", header(r, idempotencykafka.DefaultIDHeader))
		}
	}))
	if err != nil {
		return err
	}
	crashproc.Ready()
	return consumer.Run(ctx)
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }

// A consumer process is killed with SIGKILL right after a record's
// transaction committed and before its offset was committed. The restarted
// consumer is delivered the record again, replays it, and commits: each
// effect once.
func TestKilledBetweenDatabaseCommitAndOffsetCommit(t *testing.T) {
	t.Parallel()
	const n = 20
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	cfg := childConfig{Brokers: w.brokers, DatabaseURL: w.dbURL(), Group: "crash-group", Topic: "credits", InstanceID: "consumer-1", KillAfterExecuted: 5}
	startChild(t, cfg).RequireKilled(t, "after the 5th record's commit")
	rows, _ := w.credits(t)
	require.Equal(t, 5, rows, "five effects committed")
	require.Less(t, w.committed(t, "crash-group", "credits"), int64(5), "the fifth record's offset was not committed")

	cfg.KillAfterExecuted = 0
	child := startChild(t, cfg)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "crash-group", "credits") == n })
	child.Kill()
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record")
	require.Equal(t, n, distinct)
	require.Contains(t, child.Stderr(), "replayed m-4", "the record whose offset the dead process never committed came back and was replayed")
}

func startChild(t *testing.T, c childConfig) *crashproc.Child {
	t.Helper()
	b, err := json.Marshal(c)
	require.NoError(t, err)
	return crashproc.Start(t, []string{childEnv + "=" + string(b)})
}

// 10,000 records on 4 partitions, consumed by a process that is killed
// with SIGKILL at random moments eight times and restarted: effects =
// records, exactly.
func TestTenThousandRecordsWithRandomKills(t *testing.T) {
	t.Parallel()
	const n, kills = 10000, 8
	w := newWorld(t, 4, "credits")
	w.produce(t, "credits", amounts(n)...)
	seed := time.Now().UnixNano()
	rng := rand.New(rand.NewPCG(uint64(seed), 0))
	cfg := childConfig{Brokers: w.brokers, DatabaseURL: w.dbURL(), Group: "kill-group", Topic: "credits", InstanceID: "consumer-1"}
	for range kills {
		child := startChild(t, cfg)
		time.Sleep(time.Duration(200+rng.IntN(1300)) * time.Millisecond)
		child.Kill()
	}
	progress, _ := w.credits(t)
	child := startChild(t, cfg)
	waitForCount(t, "every offset committed", n, w.committedOf(t, "kill-group", "credits"))
	child.Kill()
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record (seed %d)", seed)
	require.Equal(t, n, distinct)
	t.Logf("seed %d: %d kills, %d effects committed before the last start, %d replays after it", seed, kills, progress, strings.Count(child.Stderr(), "replayed "))
}
