package idempotencykafka_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// It failed when New accepted a scope the store refuses (over 1,024
// bytes): every record then failed, retried forever.
func TestNewRefusesAScopeTheStoreCannotKeep(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	client, err := kgo.NewClient(consumerOpts(w.brokers, "g", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	_, err = idempotencykafka.New(w.store, client, credit, idempotencykafka.WithScope(strings.Repeat("s", idempotency.MaxScopeLen+1)))
	require.ErrorContains(t, err, "WithScope")
	require.ErrorContains(t, err, "the limit is 1024")
}

// A group of 1,005 characters consumes ^pay by a regex, which matches the
// topic payments-with-a-name. New checks the default scope for "" and for
// the regex itself (1,016 bytes each, within the limit of 1,024), but the
// scope of the matched topic, kafka/<group>/payments-with-a-name, has
// 1,032.
//
// Before the fix: New accepts the consumer, and every record of the
// topic is tried forever (OutcomeMisconfigured, "Message.Scope is 1032
// bytes long"): nothing is ever applied or committed.
//
// Now: New refuses a scope the store cannot keep for any
// topic it may consume (a default scope whose group leaves no room for a
// topic name of Kafka's 249 characters), or the records are applied.
func TestRegexConsumerScopeIsOneTheStoreCanKeep(t *testing.T) {
	t.Parallel()
	const topic = "payments-with-a-name"
	w := newWorld(t, 1, topic)
	w.produce(t, topic, rec("m-1", "acct-1", "100"))
	group := strings.Repeat("g", 1005)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, "^pay", kgo.ConsumeRegex())...)
	require.NoError(t, err)
	defer client.Close()
	if _, err := idempotencykafka.New(w.store, client, credit); err != nil {
		require.ErrorContains(t, err, "WithScope", "refused for its scope")
		return
	}
	var misconfigured int
	seen := make(chan idempotency.Outcome, 100)
	m := runCustom(t, w.store, client, credit, idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
		select {
		case seen <- o:
		default:
		}
	}))
	timeout := time.After(30 * time.Second)
	for done := false; !done; {
		select {
		case o := <-seen:
			if o == idempotency.OutcomeMisconfigured {
				misconfigured++
			}
			done = o == idempotency.OutcomeExecuted || misconfigured >= 3
		case <-timeout:
			done = true
		}
	}
	m.stop()
	require.Zero(t, misconfigured, "the record is never tried under a scope the store refuses")
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "the record is applied")
}

// It failed when Run took whatever the client had buffered in one poll
// (PollFetches: up to the fetch's 50 MB), which a rebalance then waited
// for: 100 records came in one or two polls. WithMaxPollRecords(10) (the
// default is 500) takes at most 10 per poll, each poll ending in a commit.
func TestPollsAreBounded(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	requests, _ := commitRequests(w.cluster, "bounded")
	w.produce(t, "credits", amounts(100)...)
	m := w.startMember(t, "bounded", "credits", idempotencykafka.WithMaxPollRecords(10), idempotencykafka.WithCommitEvery(1000))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "bounded", "credits") == 100 })
	m.stop()
	require.GreaterOrEqual(t, requests.Load(), int64(10), "a commit per poll of at most 10 records")
	_, err := idempotencykafka.New(w.store, m.client, credit, idempotencykafka.WithMaxPollRecords(0))
	require.ErrorContains(t, err, "WithMaxPollRecords")
}
