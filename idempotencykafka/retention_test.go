package idempotencykafka_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

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
