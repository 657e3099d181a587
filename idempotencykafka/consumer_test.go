package idempotencykafka_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
	"github.com/exactlyonce/idempotency/internal/crashproc"
	"github.com/exactlyonce/idempotency/internal/testdb"
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

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(crashproc.Main(runChild))
	}
	os.Exit(testdb.RunWithLeakCheck(m))
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

// consumerOpts are a group consumer's, as the helper wants them, with
// short group timeouts so that tests rebalance in seconds.
func consumerOpts(brokers []string, group, topic string, extra ...kgo.Opt) []kgo.Opt {
	return append([]kgo.Opt{
		kgo.SeedBrokers(brokers...),
		kgo.ConsumerGroup(group),
		kgo.ConsumeTopics(topic),
		kgo.DisableAutoCommit(),
		kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()),
		kgo.SessionTimeout(3 * time.Second),
		kgo.HeartbeatInterval(200 * time.Millisecond),
		kgo.FetchMaxWait(100 * time.Millisecond),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
		kgo.KeepControlRecords(),
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked),
	}, extra...)
}

// credit is the handler: the value is an amount of cents; "oops" is a
// poison record, "fail" fails every time (what follows it is quoted in the
// error), "panic" panics every time,
// "downstream-aborted" and "downstream-exhausted" fail as a downstream
// gRPC call does, "ref:X" credits against a reference that must exist when the transaction
// commits, "lock" credits 1 cent after locking the 'known' reference, with
// a lock timeout of 50 ms.
func credit(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
	v := string(r.Value)
	switch {
	case strings.HasPrefix(v, "fail"):
		return errors.New("the ledger refuses this record today" + strings.TrimPrefix(v, "fail"))
	case v == "panic":
		panic("the handler cannot read " + v)
	case v == "downstream-aborted":
		return status.Error(codes.Aborted, "the provider aborted the charge")
	case v == "downstream-exhausted":
		return status.Error(codes.ResourceExhausted, "the provider's quota is used up")
	case v == "lock":
		if _, err := tx.Exec(ctx, `SET LOCAL lock_timeout = '50ms'`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `UPDATE refs SET id = id WHERE id = 'known'`); err != nil {
			return err
		}
		v = "1"
	case strings.HasPrefix(v, "ref:"):
		_, err := tx.Exec(ctx, `INSERT INTO credits (msg_id, account, cents, ref) VALUES ($1, $2, 1, $3)`, header(r, idempotencykafka.DefaultIDHeader), string(r.Key), strings.TrimPrefix(v, "ref:"))
		return err
	}
	cents, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return idempotency.Final(fmt.Errorf("value %q is not an amount: %w", v, err))
	}
	_, err = tx.Exec(ctx, `INSERT INTO credits (msg_id, account, cents) VALUES ($1, $2, $3)`, header(r, idempotencykafka.DefaultIDHeader), string(r.Key), cents)
	return err
}

func header(r *kgo.Record, key string) string {
	for _, h := range r.Headers {
		if h.Key == key {
			return string(h.Value)
		}
	}
	return ""
}

// world is a broker, a database with the credits table (no unique
// constraint on msg_id, so that a duplicate effect would show), and a store.
//
// Its sessions commit without waiting for the WAL flush
// (synchronous_commit off): a test applies thousands of records one after
// another, each a commit, and a flush waits for a disk that the tests
// beside it, and other clients of the server, keep busy (60 ms a commit
// made a test of 3,200 records take more than 3 minutes). What a commit
// makes visible is the same; only a crash of the server, which no test
// here causes, could lose it.
type world struct {
	cluster *kfake.Cluster
	brokers []string
	db      *testdb.DB
	store   *idempotency.Store
	admin   *kadm.Client
}

func newWorld(t testing.TB, partitions int32, topics ...string) *world {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topics...), kfake.GroupMinSessionTimeout(500*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	w := &world{cluster: cluster, brokers: cluster.ListenAddrs(), db: testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "off"
	})}
	w.store, err = idempotency.NewStore(w.db.Pool)
	require.NoError(t, err)
	ctx := context.Background()
	require.NoError(t, w.store.Migrate(ctx))
	_, err = w.db.Pool.Exec(ctx, `
CREATE TABLE refs (id text PRIMARY KEY);
INSERT INTO refs VALUES ('known');
CREATE TABLE credits (
    id      bigserial PRIMARY KEY,
    msg_id  text NOT NULL,
    account text NOT NULL,
    cents   bigint NOT NULL,
    ref     text REFERENCES refs DEFERRABLE INITIALLY DEFERRED
)`)
	require.NoError(t, err)
	admin, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...))
	require.NoError(t, err)
	t.Cleanup(admin.Close)
	w.admin = kadm.NewClient(admin)
	return w
}

// dbURL is the URL of the world's database for a consumer process of the
// test's own, whose sessions commit as the world's do.
func (w *world) dbURL() string { return w.db.URL() + "&synchronous_commit=off" }

// produce sends records, each with its message-id header, and waits for
// the broker to have them.
func (w *world) produce(t testing.TB, topic string, records ...*kgo.Record) {
	t.Helper()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic(topic), kgo.RecordPartitioner(kgo.RoundRobinPartitioner()))
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, p.ProduceSync(context.Background(), records...).FirstErr())
}

func rec(id, key, value string) *kgo.Record {
	return &kgo.Record{Key: []byte(key), Value: []byte(value), Headers: []kgo.RecordHeader{{Key: idempotencykafka.DefaultIDHeader, Value: []byte(id)}}}
}

func amounts(n int) []*kgo.Record { return amountsFrom(0, n) }

// amountsFrom is n records of amounts, with the message IDs from m-<from>.
func amountsFrom(from, n int) []*kgo.Record {
	rs := make([]*kgo.Record, n)
	for i := range rs {
		j := from + i
		rs[i] = rec(fmt.Sprintf("m-%d", j), fmt.Sprintf("acct-%d", j%5), strconv.Itoa(j%100+1))
	}
	return rs
}

// committed is the group's committed offsets on topic, summed over its
// partitions: the number of records it will not see again.
func (w *world) committed(t testing.TB, group, topic string) int64 {
	t.Helper()
	var n int64
	for _, at := range w.committedByPartition(t, group, topic) {
		n += at
	}
	return n
}

// committedByPartition is the group's committed offset of each of topic's
// partitions that has one.
func (w *world) committedByPartition(t testing.TB, group, topic string) map[int32]int64 {
	t.Helper()
	at := map[int32]int64{}
	offsets, err := w.admin.FetchOffsets(context.Background(), group)
	if err != nil {
		return at // the group's coordinator is not ready yet
	}
	offsets.Each(func(o kadm.OffsetResponse) {
		if o.Topic == topic && o.Err == nil {
			at[o.Partition] = o.At
		}
	})
	return at
}

// credits is how many effects committed, and how many distinct records
// they came from.
func (w *world) credits(t testing.TB) (rows, distinct int) {
	t.Helper()
	require.NoError(t, w.db.Pool.QueryRow(context.Background(), `SELECT count(*), count(DISTINCT msg_id) FROM credits`).Scan(&rows, &distinct))
	return rows, distinct
}

// waitFor waits until done, for at most 3 minutes.
func waitFor(t *testing.T, what string, done func() bool) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Minute)
	for !done() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached in 3 minutes: %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitForCount waits until count reaches want, for as long as it moves:
// it fails once count has not moved for 3 minutes. Thousands of records
// take what the machine gives them (each is round trips to PostgreSQL and
// the broker, one after another), which no fixed time bounds; a consumer
// that stops making progress fails all the same.
func waitForCount(t *testing.T, what string, want int64, count func() int64) {
	t.Helper()
	at, moved := count(), time.Now()
	for at < want {
		if time.Since(moved) > 3*time.Minute {
			t.Fatalf("no progress in 3 minutes, at %d of %d: %s", at, want, what)
		}
		time.Sleep(50 * time.Millisecond)
		if n := count(); n != at {
			at, moved = n, time.Now()
		}
	}
}

// pollRecords polls client until it has at least n records, as a poll
// loop of one's own does (see ProcessFetches): it wakes the client's fetch
// loops before each poll, which waits a second at most, and allows the
// rebalance an empty poll held while it holds no records.
func pollRecords(t *testing.T, client *kgo.Client, n int) kgo.Fetches {
	t.Helper()
	var fetches kgo.Fetches
	deadline := time.Now().Add(3 * time.Minute)
	for len(fetches.Records()) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d records polled in 3 minutes", len(fetches.Records()), n)
		}
		client.ResumeFetchTopics()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		f := client.PollRecords(ctx, 10)
		cancel()
		if f.NumRecords() > 0 {
			fetches = append(fetches, f...)
		} else if len(fetches) == 0 {
			client.AllowRebalance()
		}
	}
	return fetches
}

// applied is how many effects committed so far, for waitForCount.
func (w *world) applied(t testing.TB) func() int64 {
	return func() int64 { rows, _ := w.credits(t); return int64(rows) }
}

// committedOf is the group's committed offsets on topic, summed, for
// waitForCount.
func (w *world) committedOf(t testing.TB, group, topic string) func() int64 {
	return func() int64 { return w.committed(t, group, topic) }
}

// member is a consumer of the group running in this process.
type member struct {
	client             *kgo.Client
	executed, replayed atomic.Int64
	inProgress         atomic.Int64
	assigned           atomic.Int64 // partitions the group gave it, over time
	consumer           *idempotencykafka.Consumer
	stop               func()
}

func (w *world) startMember(t *testing.T, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	return w.startMemberOn(t, w.store, group, topic, opts...)
}

func (w *world) startMemberOn(t *testing.T, store *idempotency.Store, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	return w.startMemberWith(t, memberConfig{store: store}, group, topic, opts...)
}

// memberConfig is what a member of a test may change: the store, options
// of its client, and a hook told of each record's outcome after the
// member counted it, before the record's offset is committed.
type memberConfig struct {
	store     *idempotency.Store
	client    []kgo.Opt
	onOutcome func(idempotency.Outcome)
}

func (w *world) startMemberWith(t *testing.T, cfg memberConfig, group, topic string, opts ...idempotencykafka.Option) *member {
	t.Helper()
	m := &member{}
	var err error
	m.client, err = kgo.NewClient(consumerOpts(w.brokers, group, topic, append([]kgo.Opt{kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
		for _, p := range ps {
			m.assigned.Add(int64(len(p)))
		}
	})}, cfg.client...)...)...)
	require.NoError(t, err)
	count := idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
		defer func() {
			if cfg.onOutcome != nil {
				cfg.onOutcome(o)
			}
		}()
		switch o {
		case idempotency.OutcomeExecuted:
			m.executed.Add(1)
		case idempotency.OutcomeReplayed:
			m.replayed.Add(1)
		case idempotency.OutcomeInProgress:
			m.inProgress.Add(1)
		}
	})
	c, err := idempotencykafka.New(cfg.store, m.client, credit, append([]idempotencykafka.Option{count}, opts...)...)
	require.NoError(t, err)
	m.consumer = c
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	m.stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			m.client.Close()
		})
	}
	t.Cleanup(m.stop)
	return m
}

// A group of two members. The second joins while the first has applied
// records whose offsets it has not committed, and is stuck (its handler
// holds it past the group's rebalance timeout): the group moves its
// partitions to the second member, which is delivered those records again
// and replays them. Each of 2,000 records' effects commits once.
func TestEachRecordOnceAcrossARebalance(t *testing.T) {
	t.Parallel()
	const n = 2000
	w := newWorld(t, 4, "credits")
	records := amounts(n)
	w.produce(t, "credits", records[:n/2]...)
	// The group waits this long for a member to rejoin before it drops it.
	fastRebalance := []kgo.Opt{kgo.RebalanceTimeout(time.Second)}

	var aExecuted atomic.Int64
	release := make(chan struct{})
	a := w.startMemberWith(t, memberConfig{store: w.store, client: fastRebalance, onOutcome: func(o idempotency.Outcome) {
		if o == idempotency.OutcomeExecuted && aExecuted.Add(1) >= n/8 {
			<-release // applied, its offset not committed
		}
	}}, "credits-group", "credits")
	waitFor(t, "member a applies some and is stuck", func() bool { return aExecuted.Load() >= n/8 })
	b := w.startMemberWith(t, memberConfig{store: w.store, client: fastRebalance}, "credits-group", "credits")
	waitFor(t, "the group drops member a and gives member b its partitions", func() bool { return b.replayed.Load() > 0 })
	close(release)
	w.produce(t, "credits", records[n/2:]...)
	waitForCount(t, "every offset committed", n, w.committedOf(t, "credits-group", "credits"))
	a.stop()
	b.stop()

	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record")
	require.Equal(t, n, distinct)
	require.Positive(t, b.replayed.Load(), "member b was delivered records member a had applied")
	require.EqualValues(t, n, a.executed.Load()+b.executed.Load(), "executions across both members")
	t.Logf("a executed %d, replayed %d; b executed %d, replayed %d", a.executed.Load(), a.replayed.Load(), b.executed.Load(), b.replayed.Load())
}

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

// Records that can never succeed go to the dead-letter topic with their
// cause, and the partition moves on: a poison record (a final error), an
// ID reused for another record, and, after their attempts, a record whose
// deferred foreign key finds no referenced row at any commit (a row that
// may still arrive, so each attempt is the handler's failure, nothing
// stored, as with an immediate foreign key) and a handler that fails every
// time.
func TestRecordsThatCanNeverSucceedAreDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments",
		rec("m-1", "acct-1", "100"),
		rec("m-2", "acct-1", "oops"),
		rec("m-1", "acct-1", "999"),
		rec("m-3", "acct-1", "ref:missing"),
		rec("m-4", "acct-1", "fail"),
		rec("m-5", "acct-1", "ref:known"),
		rec("m-6", "acct-2", "200"),
	)
	var deadLettered atomic.Int64
	m := w.startMember(t, "dl-group", "payments", idempotencykafka.WithMaxAttempts(3), idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(*kgo.Record, string) { deadLettered.Add(1) }))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "dl-group", "payments") == 7 })
	m.stop()

	var ids []string
	rows, err := w.db.Pool.Query(context.Background(), `SELECT msg_id FROM credits ORDER BY id`)
	require.NoError(t, err)
	ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"m-1", "m-5", "m-6"}, ids, "the good records' effects, once each")
	require.EqualValues(t, 4, deadLettered.Load())

	dl := w.readAll(t, "payments.dead-letter", 4)
	type letter struct{ offset, id, outcome, cause string }
	var got []letter
	for _, r := range dl {
		got = append(got, letter{header(r, idempotencykafka.HeaderOffset), header(r, idempotencykafka.HeaderMessageID), header(r, idempotencykafka.HeaderOutcome), header(r, idempotencykafka.HeaderCause)})
		require.Equal(t, "payments", header(r, idempotencykafka.HeaderTopic))
		require.Equal(t, header(r, idempotencykafka.DefaultIDHeader), header(r, idempotencykafka.HeaderMessageID), "the original headers are kept")
	}
	require.Len(t, got, 4)
	for i, want := range []struct{ offset, id, outcome, cause string }{
		{"1", "m-2", "executed", "is not an amount"},
		{"2", "m-1", "key_reused", "different request"},
		{"3", "m-3", "released", "gave up after 3 attempts: idempotency: the call's writes violate constraint credits_ref_fkey"},
		{"4", "m-4", "released", "gave up after 3 attempts: the ledger refuses this record today"},
	} {
		require.Equal(t, want.offset, got[i].offset, "dead letter %d", i)
		require.Equal(t, want.id, got[i].id, "dead letter %d", i)
		require.Equal(t, want.outcome, got[i].outcome, "dead letter %d", i)
		require.Contains(t, got[i].cause, want.cause, "dead letter %d", i)
	}
}

// readAll reads n records of topic from its start.
func (w *world) readAll(t *testing.T, topic string, n int) []*kgo.Record {
	t.Helper()
	c, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumeTopics(topic), kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	require.NoError(t, err)
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		f := c.PollFetches(ctx)
		require.NoError(t, ctx.Err(), "read %d of %d records of %s", len(out), n, topic)
		out = append(out, f.Records()...)
	}
	return out
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

// A record whose ID is held by someone else (the member that had its
// partition before a rebalance, still applying it) is waited for, never
// skipped: the consumer commits its offset only once the holder committed,
// and then replays the holder's outcome.
func TestRecordHeldElsewhereIsWaitedForNeverSkipped(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	store, err := idempotency.NewStore(w.db.Pool, idempotency.WithInProgressWait(20*time.Millisecond))
	require.NoError(t, err)
	r := rec("m-1", "acct-1", "100")
	w.produce(t, "credits", r, rec("m-2", "acct-1", "5"))

	// The other member: holds m-1 until told to commit.
	client, err := kgo.NewClient(consumerOpts(w.brokers, "held-group", "credits")...)
	require.NoError(t, err)
	probe, err := idempotencykafka.New(store, client, credit)
	require.NoError(t, err)
	msg, err := probe.Message(context.Background(), r)
	require.NoError(t, err)
	client.Close()
	holding, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		_, err := store.ProcessMessage(context.Background(), msg, func(ctx context.Context, tx pgx.Tx) error {
			close(holding)
			<-release
			return credit(ctx, tx, r)
		})
		held <- err
	}()
	<-holding

	m := w.startMemberOn(t, store, "held-group", "credits", idempotencykafka.WithRetryBackoff(5*time.Millisecond, 20*time.Millisecond))
	waitFor(t, "the consumer finds m-1 held", func() bool { return m.inProgress.Load() >= 3 })
	require.Zero(t, w.committed(t, "held-group", "credits"), "nothing committed past the held record")
	rows, _ := w.credits(t)
	require.Zero(t, rows, "m-2 waits behind m-1: a partition keeps its order")
	close(release)
	require.NoError(t, <-held)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "held-group", "credits") == 2 })
	m.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, rows)
	require.Equal(t, 2, distinct)
	require.EqualValues(t, 1, m.replayed.Load(), "m-1: the holder's effect, replayed")
	require.EqualValues(t, 1, m.executed.Load(), "m-2")
}

// A client that would commit offsets on its own, or consumes no group, is
// refused with what to set.
func TestNewRefusesAClientThatCommitsAheadOfTheDatabase(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	for _, c := range []struct {
		opts []kgo.Opt
		want string
	}{
		{[]kgo.Opt{kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits")}, "set kgo.DisableAutoCommit"},
		{[]kgo.Opt{kgo.SeedBrokers(w.brokers...), kgo.ConsumeTopics("credits")}, "set kgo.ConsumerGroup"},
	} {
		client, err := kgo.NewClient(c.opts...)
		require.NoError(t, err)
		_, err = idempotencykafka.New(w.store, client, credit)
		client.Close()
		require.ErrorContains(t, err, c.want)
	}
	client, err := kgo.NewClient(consumerOpts(w.brokers, "g", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	_, err = idempotencykafka.New(w.store, client, credit, idempotencykafka.WithMaxAttempts(0))
	require.ErrorContains(t, err, "WithMaxAttempts")
}

// A record whose handler meets the database's trouble (here a lock
// timeout, for as long as another transaction holds the row) is the
// database's problem, not the record's: it is tried again past its
// attempts, never dead-lettered, and applied once the lock is free.
func TestDatabaseTroubleInTheHandlerIsWaitedNotDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	ctx := context.Background()
	holder, err := w.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM refs WHERE id = 'known' FOR UPDATE`)
	require.NoError(t, err)

	w.produce(t, "credits", rec("m-1", "acct-1", "lock"))
	var released atomic.Int64
	var deadLettered atomic.Int64
	m := w.startMember(t, "lock-group", "credits", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
			if o == idempotency.OutcomeReleased {
				released.Add(1)
			}
		}),
		idempotencykafka.WithDeadLetterHandler(func(*kgo.Record, string) { deadLettered.Add(1) }))
	waitFor(t, "the record meets the lock more times than its attempts", func() bool { return released.Load() >= 5 })
	require.Zero(t, w.committed(t, "lock-group", "credits"))
	require.NoError(t, holder.Rollback(ctx))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "lock-group", "credits") == 1 })
	m.stop()
	require.Zero(t, deadLettered.Load(), "never dead-lettered")
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}

// A handler that panics on a record every time does not crash the
// consumer: the record's transaction rolls back, and after its attempts it
// is dead-lettered with the panic as its cause.
func TestHandlerPanicIsDeadLetteredAfterItsAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	w.produce(t, "credits", rec("m-1", "acct-1", "panic"), rec("m-2", "acct-1", "7"))
	var causes []string
	var mu sync.Mutex
	m := w.startMember(t, "panic-group", "credits", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(_ *kgo.Record, cause string) {
			mu.Lock()
			defer mu.Unlock()
			causes = append(causes, cause)
		}))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "panic-group", "credits") == 2 })
	m.stop()
	mu.Lock()
	defer mu.Unlock()
	require.Equal(t, []string{"gave up after 2 attempts: the handler panicked: the handler cannot read panic"}, causes)
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "m-2 applied; m-1's writes rolled back")
}

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }
