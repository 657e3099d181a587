package idempotencykafka_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// setRetention sets topic's retention.ms.
func (w *world) setRetention(t *testing.T, topic string, d time.Duration) {
	t.Helper()
	ms := strconv.FormatInt(d.Milliseconds(), 10)
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, topic)
	require.NoError(t, err)
}

// testClock is a consumer's clock that a test moves on instead of waiting.
type testClock struct{ ahead atomic.Int64 }

func (c *testClock) now() time.Time { return time.Now().Add(time.Duration(c.ahead.Load())) }

// pass moves the clock d on.
func (c *testClock) pass(d time.Duration) { c.ahead.Add(int64(d)) }

// A consumer runs on payments, whose retention.ms is an hour: it keeps
// IDs 14 days and an hour (the hour, segment.ms's 7 days, the offsets' 7).
// An operator raises the topic to 30 days with AlterTopicConfigs; three
// records are produced and applied. Fifteen days later (the IDs' expiry
// moved back) the group is reset to the earliest offset with kadm, as an
// operator does, and reads the three records again: the topic keeps them
// 30 days.
//
// Before the fix: the consumer read the topic's configs once, at the
// start, and gave the three records' IDs 14 days where 44 are needed
// (30 days, a segment's 7, the offsets' 7): the reset group finds them
// forgotten and applies the records again, 6 effects.
//
// Now: configs read a minute ago (the clock moved on instead of waiting)
// are read again before a record's TTL is computed from them: the IDs
// outlast the raised retention, and the reset group replays the records.
func TestRetentionRaisedWhileTheConsumerRunsIsSeen(t *testing.T) {
	t.Parallel()
	const group, topic = "raised", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	clock := &testClock{}
	var replayed atomic.Int64
	opts := []idempotencykafka.Option{idempotencykafka.WithClock(clock.now), idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
		if o == idempotency.OutcomeReplayed {
			replayed.Add(1)
		}
	})}
	m := w.startCustom(t, w.store, group, topic, credit, nil, opts...)
	require.NoError(t, m.consumer.CheckRetention(context.Background()), "the consumer knows the topic's hour")

	w.setRetention(t, topic, 30*24*time.Hour)
	clock.pass(idempotencykafka.RetentionRefresh)
	w.produce(t, topic, amounts(3)...)
	waitFor(t, "the three records applied", func() bool { return w.committed(t, group, topic) == 3 })
	m.stop()
	w.logTTL(t)
	assert.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '43 days'`),
		"the IDs outlast the raised retention (30 days), a segment's 7 days and the offsets' 7")

	w.passDays(t, 15)
	_, err := w.admin.CommitOffsets(context.Background(), group, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 0, LeaderEpoch: -1}}})
	require.NoError(t, err, "the group reset to the earliest offset")
	require.Zero(t, w.committed(t, group, topic))
	again := w.startCustom(t, w.store, group, topic, credit, nil, opts...)
	waitFor(t, "the three records read again", func() bool { return w.committed(t, group, topic) == 3 })
	again.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 3, distinct)
	require.Equal(t, 3, rows, "each record applied once (replayed: %d)", replayed.Load())
}

// A consumer with WithTTL(20 days) runs on payments, whose retention.ms
// is an hour (the IDs need 14 days and an hour). An operator raises the
// topic to 30 days; three records are produced.
//
// Before the fix: the consumer applies them with IDs kept 20 days where 44
// are needed, and runs on, saying nothing.
//
// Now: the raise is seen before the records are applied (the clock moved
// past the configs' minute), and the TTL is refused as it is at the start:
// Run returns an error that names the topic, its retention, the TTL and
// what to set; no record is applied, no offset committed.
func TestWithTTLMadeTooShortByARaiseStopsRun(t *testing.T) {
	t.Parallel()
	const group, topic = "raised-ttl", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	clock := &testClock{}
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic)...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(20*24*time.Hour), idempotencykafka.WithClock(clock.now),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	require.NoError(t, err)
	require.NoError(t, c.CheckRetention(context.Background()), "20 days outlast the hour")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()

	w.setRetention(t, topic, 30*24*time.Hour)
	clock.pass(idempotencykafka.RetentionRefresh)
	w.produce(t, topic, amounts(3)...)
	var runErr error
	stopped := false
	waitFor(t, "Run stops, or the records are applied", func() bool {
		select {
		case runErr = <-done:
			stopped = true
		default:
		}
		return stopped || w.committed(t, group, topic) == 3
	})
	rows, _ := w.credits(t)
	require.True(t, stopped, "Run goes on after the raise (%d records applied with IDs kept 20 days)", rows)
	t.Logf("Run: %v", runErr)
	require.False(t, errors.Is(runErr, context.Canceled), "Run: %v", runErr)
	require.ErrorContains(t, runErr, "WithTTL(480h0m0s) is shorter than topic payments's retention.ms (720h0m0s)")
	require.ErrorContains(t, runErr, "set at least 1056h0m0s")
	require.Zero(t, rows, "no record applied with IDs kept too short")
	require.Zero(t, w.db.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Zero(t, w.committed(t, group, topic))
}

// payments keeps its records 7 days, its dead-letter topic 30: the IDs of
// payments need 44 days (30, a segment's 7, the offsets' 7), as a dead
// letter read back is its record. The broker does not tell the consumer
// the dead-letter topic's configs: its ACLs let the client describe
// payments but not payments.dead-letter, or the broker times the request
// out once.
//
// Before the fix: an error of the dead-letter topic's configs that kadm
// does not raise for the whole request (a timeout, a broker's failure) was
// taken for "no dead-letter topic": the three records were applied with IDs
// kept 21 days, and that TTL was used for a minute.
//
// Now: only a dead-letter topic that does not exist is left out; a read
// that failed is tried again, and the records wait for it. Configs the
// client may not read (kadm raises that for the request) refuse Run
// without WithTTL, and WithTTL stands for them with it, as before.
func TestDeadLetterTopicsConfigsThatCannotBeReadAreNotSkipped(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		err     *kerr.Error
		count   int // requests faulted, -1 for all
		opts    []idempotencykafka.Option
		refused string        // Run's error, when it refuses
		ttl     time.Duration // else: the IDs' TTL at least
	}{
		{name: "not authorized", err: kerr.TopicAuthorizationFailed, count: -1,
			refused: "TOPIC_AUTHORIZATION_FAILED"},
		{name: "not authorized, WithTTL", err: kerr.TopicAuthorizationFailed, count: -1,
			opts: []idempotencykafka.Option{idempotencykafka.WithTTL(50 * 24 * time.Hour)}, ttl: 49 * 24 * time.Hour},
		{name: "timed out once", err: kerr.RequestTimedOut, count: 1, ttl: 43 * 24 * time.Hour},
		{name: "failed twice", err: kerr.UnknownServerError, count: 2, ttl: 43 * 24 * time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			w := newWorld(t, 1, "payments", "payments.dead-letter")
			w.thirtyDays(t, "payments.dead-letter")
			w.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.DescribeConfigs}, Resource: "payments.dead-letter", Err: tc.err, Count: tc.count})
			w.produce(t, "payments", amounts(3)...)
			client, err := kgo.NewClient(consumerOpts(w.brokers, "dlt-configs", "payments")...)
			require.NoError(t, err)
			defer client.Close()
			opts := append([]idempotencykafka.Option{idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond)}, tc.opts...)
			c, err := idempotencykafka.New(w.store, client, credit, opts...)
			require.NoError(t, err)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			done := make(chan error, 1)
			go func() { done <- c.Run(ctx) }()
			var runErr error
			stopped := false
			waitFor(t, "Run stops, or the records are applied", func() bool {
				select {
				case runErr = <-done:
					stopped = true
				default:
				}
				return stopped || w.committed(t, "dlt-configs", "payments") == 3
			})
			if !stopped {
				cancel()
				runErr = <-done
			}
			rows, _ := w.credits(t)
			t.Logf("Run: %v", runErr)
			if tc.refused != "" {
				require.True(t, stopped, "Run goes on without the dead-letter topic's configs (%d records applied)", rows)
				require.ErrorContains(t, runErr, tc.refused)
				require.Zero(t, rows, "no record applied with a TTL that leaves the dead-letter topic out")
				return
			}
			require.ErrorIs(t, runErr, context.Canceled)
			require.Equal(t, 3, rows)
			w.logTTL(t)
			require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + make_interval(secs => $1)`, tc.ttl.Seconds()),
				"the IDs outlast the dead-letter topic's 30 days, a segment's 7 and the offsets' 7")
		})
	}
}

// payments keeps its records an hour. A producer whose clock is 30 days
// ahead (or that sets its records' timestamps itself) produces R: Kafka
// deletes a record once its timestamp is past retention.ms, so it keeps R
// 30 days and an hour, where a record stamped now goes after the hour. S,
// stamped now, is produced before it. Both are applied. Fifteen days later
// (the IDs' expiry moved back 15 days, S deleted by its hour) the group is
// reset to the earliest offset and reads R again.
//
// Before the fix: R's ID was kept 14 days and an hour from when it was
// applied, as S's, and R was applied a second time.
//
// Now: a record's ID is kept for as long as its timestamp is ahead of the
// consumer's clock beyond the topic's TTL, and R is replayed.
func TestFutureTimestampedRecordsIDOutlastsIt(t *testing.T) {
	t.Parallel()
	const group, topic = "future", "payments"
	w := newWorld(t, 1, topic)
	w.setRetention(t, topic, time.Hour)
	s, r := rec("s", "acct-1", "100"), rec("r", "acct-2", "200")
	r.Timestamp = time.Now().Add(30 * 24 * time.Hour)
	w.produce(t, topic, s)
	w.produce(t, topic, r)
	m := w.startMember(t, group, topic)
	waitFor(t, "S and R applied", func() bool { return w.committed(t, group, topic) == 2 })
	m.stop()
	w.logTTL(t)

	w.passDays(t, 15)
	ctx := context.Background()
	_, err := w.admin.DeleteRecords(ctx, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 1}}})
	require.NoError(t, err, "S deleted by its hour of retention")
	_, err = w.admin.CommitOffsets(ctx, group, kadm.Offsets{topic: {0: kadm.Offset{Topic: topic, Partition: 0, At: 0, LeaderEpoch: -1}}})
	require.NoError(t, err, "the group reset to the earliest offset")
	again := w.startMember(t, group, topic)
	waitForCount(t, "R read again", 1, func() int64 { return again.executed.Load() + again.replayed.Load() })
	again.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, distinct)
	require.Equal(t, 2, rows, "R applied once (replayed: %d)", again.replayed.Load())
}

// The client may describe its topics' configs but not the brokers' (a
// cluster-level ACL applications are seldom given), and has WithTTL(2
// days); payments keeps its records 30 days, which the client can read.
//
// Before the fix: the brokers' configs refused, WithTTL was taken for the
// TTL without reading the topic's: the three records were applied with
// IDs kept 2 days, where the topic's own retention needs 37 at least.
//
// Now: WithTTL stands for the offsets' retention, which cannot be read,
// and is still held to what can: Run refuses it, naming the topic's
// retention; nothing is applied.
func TestWithTTLIsHeldToTheTopicsRetentionWhenTheBrokersConfigsAreRefused(t *testing.T) {
	t.Parallel()
	const group, topic = "broker-configs-refused", "payments"
	w := newWorld(t, 1, topic)
	w.thirtyDays(t, topic)
	w.cluster.Fault(kfake.Fault{Keys: []kmsg.Key{kmsg.DescribeConfigs}, Resource: "0", Err: kerr.ClusterAuthorizationFailed, Count: -1})
	w.produce(t, topic, amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic)...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(2*24*time.Hour))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var runErr error
	stopped := false
	waitFor(t, "Run stops, or the records are applied", func() bool {
		select {
		case runErr = <-done:
			stopped = true
		default:
		}
		return stopped || w.committed(t, group, topic) == 3
	})
	rows, _ := w.credits(t)
	require.True(t, stopped, "Run goes on with WithTTL(48h) on a topic that keeps its records 30 days (%d records applied)", rows)
	t.Logf("Run: %v", runErr)
	require.ErrorContains(t, runErr, "WithTTL(48h0m0s) is shorter than topic payments's retention.ms (720h0m0s)")
	require.Zero(t, rows)
}

// It failed when the ID's lifetime defaulted to the engine's 24 hours
// while Kafka keeps records and an idle group's offsets 7 days each: 10
// records consumed, their keys two days old, the group's offsets deleted,
// and the group read the topic again: 20 effects. Run now derives the TTL
// from the topic's retention.ms and the brokers' offsets.retention.minutes
// (here 7 days each), so the keys outlast both: 10 effects, 10 replays.
func TestDefaultTTLOutlastsRetentionAndOffsets(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(10)...)
	m := w.startMember(t, "ttl-group", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "ttl-group", "credits") == 10 })
	m.stop()
	ctx := context.Background()
	require.Equal(t, 10, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`), "the keys outlast retention and offsets")
	_, err := w.db.Pool.Exec(ctx, `UPDATE idempotency_keys SET created_at = created_at - interval '2 days', expires_at = expires_at - interval '2 days'`)
	require.NoError(t, err)
	_, err = w.admin.DeleteGroups(ctx, "ttl-group")
	require.NoError(t, err)

	again := w.startMember(t, "ttl-group", "credits")
	waitFor(t, "every offset committed again", func() bool { return w.committed(t, "ttl-group", "credits") == 10 && again.replayed.Load() == 10 })
	again.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 10, rows, "each record applied once")
}

// An explicit TTL shorter than retention plus the offsets' retention is
// refused by Run, naming both; a topic that keeps its records forever
// needs an explicit TTL, and runs with one.
func TestTTLShorterThanRetentionIsRefused(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "forever")
	ctx := context.Background()
	forever := "-1"
	_, err := w.admin.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "retention.ms", Value: &forever}}, "forever")
	require.NoError(t, err)
	run := func(topic string, opts ...idempotencykafka.Option) error {
		client, err := kgo.NewClient(consumerOpts(w.brokers, "g-"+topic, topic)...)
		require.NoError(t, err)
		defer client.Close()
		c, err := idempotencykafka.New(w.store, client, credit, opts...)
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		return c.Run(ctx)
	}
	err = run("credits", idempotencykafka.WithTTL(time.Hour))
	require.ErrorContains(t, err, "WithTTL(1h0m0s) is shorter than topic credits's retention.ms (168h0m0s) and segment.ms (168h0m0s) plus the brokers' offsets.retention.minutes (168h0m0s)")
	require.ErrorContains(t, err, "set at least 504h0m0s")
	require.ErrorIs(t, run("credits", idempotencykafka.WithTTL(22*24*time.Hour)), context.DeadlineExceeded, "a long enough TTL runs")
	require.ErrorContains(t, run("forever"), "keeps its records forever")
	require.ErrorIs(t, run("forever", idempotencykafka.WithTTL(30*24*time.Hour)), context.DeadlineExceeded, "an explicit TTL is the operator's decision")
}

// A DescribeConfigs that fails once, for a reason that may pass (a
// timeout), does not stop Run without WithTTL (as it did), nor lets it go
// on with a TTL it did not read: Run reads the configs again, and the
// records' IDs are kept for the topic's retention and the offsets'.
func TestRunReadsTheConfigsAgainAfterATransientFailure(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	failed := failDescribeConfigsOnce(w.cluster)
	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "configs-again", "credits", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "configs-again", "credits") == 3 })
	m.stop()
	require.True(t, failed.Load())
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`))
}

// A topic's dead letters are its records: read back from a dead-letter
// topic that keeps them 30 days, they must find their IDs, so the IDs of
// the topic's records outlast the dead-letter topic's retention too.
func TestIDsOutlastTheDeadLetterTopicsRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	ms := "2592000000"
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, "payments.dead-letter")
	require.NoError(t, err)
	w.produce(t, "payments", amounts(3)...)
	m := w.startMember(t, "dlt-retention", "payments")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "dlt-retention", "payments") == 3 })
	m.stop()
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`))
}

// A compacted topic (cleanup.policy=compact) keeps the last record of
// every key forever: its retention.ms (7 days, the default the broker
// reports) deletes nothing. A group whose offsets expire re-reads records
// of any age.
//
// Before the fix: CheckRetention reads retention.ms alone, derives a
// TTL of 14 days, and Run runs: a record re-read after 14 days finds its
// ID forgotten and is applied again.
//
// Now: a topic whose cleanup.policy does not delete (compact
// without delete) keeps its records forever, as retention.ms -1 does: Run
// refuses it without an explicit WithTTL.
func TestCompactedTopicNeedsAnExplicitTTL(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "ledger")
	ctx := context.Background()
	compact := "compact"
	_, err := w.admin.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "cleanup.policy", Value: &compact}}, "ledger")
	require.NoError(t, err)
	rcs, err := w.admin.DescribeTopicConfigs(ctx, "ledger")
	require.NoError(t, err)
	rc, err := rcs.On("ledger", nil)
	require.NoError(t, err)
	policy := ""
	for _, c := range rc.Configs {
		if c.Key == "cleanup.policy" && c.Value != nil {
			policy = *c.Value
		}
	}
	require.Equal(t, "compact", policy, "the broker reports the topic compacted")

	client, err := kgo.NewClient(consumerOpts(w.brokers, "compact-group", "ledger")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.ErrorContains(t, c.Run(rctx), "forever", "Run refuses a compacted topic without an explicit TTL")
}

// Consumer.Message is documented for code that applies a record outside
// the consumer (a tool, a second path), "so that the two never both apply
// it". Such code builds a Consumer with New, for the Message, and does not
// Run it.
//
// Before the fix: Message's TTL is 0 until Run's CheckRetention set it,
// so the ID is kept the engine's default 24 hours: the consumer that reads
// the record later (its group lagging, or re-reading after its offsets
// expired, within the topic's 7 days) finds the ID forgotten and applies
// the record a second time.
//
// Now: the Message of a record outlasts the topic's
// retention and the offsets' (14 days here) however the Consumer was used,
// or Message refuses until the retention is known.
func TestMessageAppliedOutsideTheConsumerOutlastsRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	client, err := kgo.NewClient(consumerOpts(w.brokers, "outside-group", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	r := rec("m-1", "acct-1", "100")
	r.Topic = "credits"
	m, err := c.Message(context.Background(), r)
	require.NoError(t, err)
	_, err = w.store.ProcessMessage(context.Background(), m, func(ctx context.Context, tx pgx.Tx) error { return credit(ctx, tx, r) })
	require.NoError(t, err)
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`),
		"the ID outlasts the topic's retention and the offsets' (TTL of the Message: %v)", m.TTL)
}

// A group consumes ^payments by a regex; the topic keeps its records 30
// days (retention.ms), longer than the brokers' log.retention.ms (7 days).
//
// Before the fix: CheckRetention holds regex topics to the brokers'
// log.retention.ms and derives a TTL of 14 days: a record re-read after
// the group's offsets expired (up to 37 days after it was produced) finds
// its ID forgotten and is applied again.
//
// Now: the TTL outlasts the retention.ms of every topic
// consumed (the topics the regex matched, which the client knows), here at
// least 37 days.
func TestRegexTopicsTTLOutlastsTheirOwnRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	w.thirtyDays(t, "payments")
	w.produce(t, "payments", amounts(3)...)
	m := w.startCustom(t, w.store, "regex-ttl", "^payments$", credit, []kgo.Opt{kgo.ConsumeRegex()})
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "regex-ttl", "payments") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`),
		"the IDs outlast the topic's 30 days and the offsets' 7")
}

// A consumer of "credits" (7 days) that the application also gives
// "payments" (30 days) with kgo.Client.AddConsumeTopics before Run.
//
// Before the fix: CheckRetention reads the topics the client was created
// with (OptValue(kgo.ConsumeTopics)), not those it consumes: the TTL is 14
// days, and the payments records re-read after the offsets expired are
// applied again.
//
// Now: every topic the client consumes is held to its own
// retention.ms (kgo.Client.GetConsumeTopics), here at least 37 days.
func TestAddedTopicsTTLOutlastsTheirRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "payments")
	w.thirtyDays(t, "payments")
	w.produce(t, "payments", amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "added-ttl", "credits")...)
	require.NoError(t, err)
	client.AddConsumeTopics("payments")
	m := runCustom(t, w.store, client, credit)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "added-ttl", "payments") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`),
		"the IDs outlast the topic's 30 days and the offsets' 7")
}

// WithTTL(1h) on a topic of Kafka's defaults (7 days of retention, 7 days
// of offsets): when the configs can be read, Run refuses it
// (TestTTLShorterThanRetentionIsRefused). Here the broker fails the
// consumer's first DescribeConfigs request only, with a retriable error
// (a request timeout), and answers every later one.
//
// Before the fix: the one failure makes the consumer go on with WithTTL(1h) and
// cache it as the topic's TTL for the rest of the run: every record is
// applied with IDs kept an hour, though the topic and offsets keep them
// 14 days, and nothing reads the configs again.
//
// Now: a failure to read the configs is not taken as the operator's
// word for good: the configs are read again (the record waits, or the
// TTL is checked once they answer), and a WithTTL shorter than needed is
// refused as it is when the first read succeeds.
func TestShortTTLIsRefusedAfterATransientDescribeConfigsFailure(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	failed := failDescribeConfigsOnce(w.cluster)
	w.produce(t, "credits", amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "ttl-transient", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(time.Hour),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.ErrorContains(t, c.Run(ctx), "WithTTL(1h0m0s) is shorter than", "refused once the configs answer")
	require.True(t, failed.Load(), "the first DescribeConfigs failed")
	short := w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at < now() + interval '2 hours'`)
	require.Zero(t, short, "no record is applied with IDs kept an hour on a topic that redelivers for 14 days")
}

// The brokers keep a group's offsets one day (offsets.retention.minutes
// 1440, as clusters that recycle many short-lived groups set it); the
// topic has Kafka's defaults: retention.ms and segment.ms of 7 days.
//
// Kafka deletes records by whole segments, once a segment's newest record
// is older than retention.ms, and a segment takes records for up to
// segment.ms: a record of a segment started when it was produced is
// readable for up to retention.ms plus segment.ms, here 14 days. A group
// that re-reads the topic (its offsets expired after a day without a
// member, reset, a group recreated) reads it for all that time.
//
// Before the fix: the TTL is retention.ms plus offsets.retention.minutes, 8 days, and
// segment.ms is never read: a record re-read between its 8th and its 14th
// day finds its ID forgotten and is applied again.
//
// Now: the IDs of a topic's records outlast what Kafka may still
// deliver of it, at least retention.ms plus segment.ms (14 days here).
func TestTTLOutlastsTheTopicsSegmentsToo(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	day := "1440"
	resps, err := w.admin.AlterBrokerConfigs(context.Background(), []kadm.AlterConfig{{Name: "offsets.retention.minutes", Value: &day}})
	require.NoError(t, err)
	for _, r := range resps {
		require.NoError(t, r.Err)
	}
	rcs, err := w.admin.DescribeTopicConfigs(context.Background(), "credits")
	require.NoError(t, err)
	segment := ""
	for _, rc := range rcs {
		for _, c := range rc.Configs {
			if c.Key == "segment.ms" && c.Value != nil {
				segment = *c.Value
			}
		}
	}
	require.Equal(t, "604800000", segment, "the broker reports segment.ms of 7 days")

	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "segment-ttl", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "segment-ttl", "credits") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days 23 hours'`),
		"the IDs outlast the topic's retention.ms and segment.ms (7 days each)")
}

// Group A reads payments and cannot apply R (a final error of its
// handler): it dead-letters R to payments.dead-letter, whose retention.ms
// is 30 days (an operator keeps dead letters longer than records, to have
// time to redrive them). Group B reads ^payments.* by a regex, the case
// the package supports: it applies R from payments, then reads A's dead
// letter of R, identified as R (the promise of the redrive and dead-letter tests: a dead
// letter is its record, for every group), and replays it. B then stops.
//
// Fifteen days later (simulated: the IDs' expiry moved back 15 days, R
// deleted from payments by its 7 days of retention, B's offsets expired
// after the brokers' 7 days) B starts again and reads its topics from the
// start: payments.dead-letter still has the dead letter, for 15 more days.
//
// Before the fix: the dead letter's ID is given the TTL of its original's topic,
// payments (7 days of retention and 7 of offsets: 14 days), and B's ID of
// R was stored with that TTL when B applied R; nothing accounts for the
// dead-letter topic, where a record standing for R is kept 30 days (and 37
// before a group whose offsets expired stops reading it). B finds R's ID
// forgotten and applies R's effect a second time.
//
// Now: every group applies R at most once, whatever record stands for
// it: an ID outlasts every record it identifies, the dead letters read by
// regex included (or a record standing for an ID that may have been
// forgotten is not applied).
func TestDeadLetterKeptLongerThanItsOriginalIsNeverAppliedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.thirtyDays(t, "payments.dead-letter")
	ctx := context.Background()
	w.createApplied(t)
	w.produce(t, "payments", rec("r", "acct-1", "100"))
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	a := w.startCustom(t, w.store, "group-a", "payments", applyAs("a", func() bool { return true }), nil, backoff)
	waitFor(t, "A dead-letters R", func() bool { return w.end(t, "payments.dead-letter") == 1 })
	a.stop()
	regex := []kgo.Opt{kgo.ConsumeRegex()}
	b := w.startCustom(t, w.store, "group-b", "^payments.*", applyAs("b", nil), regex, backoff)
	waitFor(t, "B read R and its dead letter", func() bool {
		return w.committed(t, "group-b", "payments") == 1 && w.committed(t, "group-b", "payments.dead-letter") == 1
	})
	b.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "B applied R once so far")
	w.logTTL(t)

	// Fifteen days later.
	w.passDays(t, 15)
	_, err := w.admin.DeleteRecords(ctx, kadm.Offsets{"payments": {0: kadm.Offset{Topic: "payments", Partition: 0, At: 1}}})
	require.NoError(t, err, "R deleted from payments by its retention")
	_, err = w.admin.DeleteGroups(ctx, "group-b")
	require.NoError(t, err, "B's offsets expired")

	again := w.startCustom(t, w.store, "group-b", "^payments.*", applyAs("b", nil), regex, backoff)
	waitFor(t, "B read the dead-letter topic again", func() bool { return w.committed(t, "group-b", "payments.dead-letter") == 1 })
	again.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "group B applies R once, whatever record stands for it")
}
