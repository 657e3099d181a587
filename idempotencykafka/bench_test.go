package idempotencykafka_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// BenchmarkConsume consumes b.N records from 4 partitions of kfake into
// the real database, side by side in each round:
//
//   - plain: the same consumer loop and handler, each record's effect in a
//     transaction of its own, offsets committed the same way (every 100
//     records of a partition, and the poll's last offsets in one request
//     at its end), no deduplication;
//   - helper: idempotencykafka, each record's effect committed with its ID;
//   - helper/max-poll-500: the helper taking at most 500 records a poll
//     (the default is 10,000), what a tighter bound costs: franz-go fills
//     a poll partition by partition, so a bound below a partition's
//     backlog leaves the other partitions for the next poll;
//   - helper/commit-per-partition: the helper committing each partition's
//     last offset of a poll in a request of its own, what one commit per
//     poll saves;
//   - helper/commit-every-1: the helper committing the offset after every
//     record, what a batch of 100 saves.
//
// Time runs from the first record's handler to the last offset committed,
// so that joining the group (a second or more, and varying) is not in it.
// It reports records/s and µs per record. Compare within a round:
//
//	go -C idempotencykafka test -run '^$' -bench Consume -benchtime 5000x -count 6 .
func BenchmarkConsume(b *testing.B) {
	for _, v := range []struct {
		name string
		run  func(ctx context.Context, w *world, client *kgo.Client, handle idempotencykafka.Handler) error
	}{
		{"plain", plainConsume},
		{"helper", helperConsume(idempotencykafka.WithCommitEvery(100))},
		{"helper/max-poll-500", helperConsume(idempotencykafka.WithCommitEvery(100), idempotencykafka.WithMaxPollRecords(500))},
		{"helper/commit-per-partition", helperConsume(idempotencykafka.WithCommitEvery(100), idempotencykafka.WithCommitPerPartition())},
		{"helper/commit-every-1", helperConsume(idempotencykafka.WithCommitEvery(1))},
	} {
		b.Run(v.name, func(b *testing.B) {
			w := newWorld(b, 4, "credits")
			n := b.N
			w.produceN(b, n)
			client, err := kgo.NewClient(consumerOpts(w.brokers, "bench", "credits")...)
			if err != nil {
				b.Fatal(err)
			}
			defer client.Close()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan error, 1)
			var first atomic.Int64 // unix ns of the first record's handler
			handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
				if first.Load() == 0 {
					first.CompareAndSwap(0, time.Now().UnixNano())
				}
				return credit(ctx, tx, r)
			}
			b.ResetTimer()
			go func() { done <- v.run(ctx, w, client, handle) }()
			for w.committed(b, "bench", "credits") < int64(n) {
				time.Sleep(5 * time.Millisecond)
			}
			elapsed := time.Since(time.Unix(0, first.Load()))
			b.StopTimer()
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				b.Fatal(err)
			}
			b.ReportMetric(float64(n)/elapsed.Seconds(), "records/s")
			b.ReportMetric(float64(elapsed.Microseconds())/float64(n), "µs/record")
		})
	}
}

func helperConsume(opts ...idempotencykafka.Option) func(ctx context.Context, w *world, client *kgo.Client, handle idempotencykafka.Handler) error {
	return func(ctx context.Context, w *world, client *kgo.Client, handle idempotencykafka.Handler) error {
		c, err := idempotencykafka.New(w.store, client, handle, opts...)
		if err != nil {
			return err
		}
		return c.Run(ctx)
	}
}

// plainConsume is the consumer without deduplication: the same loop, the
// same handler in a transaction of its own, the same offset commits.
func plainConsume(ctx context.Context, w *world, client *kgo.Client, handle idempotencykafka.Handler) error {
	for {
		fetches := client.PollRecords(ctx, 10000)
		if ctx.Err() != nil || fetches.IsClientClosed() {
			client.AllowRebalance()
			return ctx.Err()
		}
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			last []*kgo.Record
		)
		fetches.EachPartition(func(p kgo.FetchTopicPartition) {
			wg.Go(func() {
				for i, r := range p.Records {
					if err := pgx.BeginFunc(ctx, w.db.Pool, func(tx pgx.Tx) error { return handle(ctx, tx, r) }); err != nil {
						return
					}
					switch {
					case i == len(p.Records)-1:
						mu.Lock()
						last = append(last, r)
						mu.Unlock()
					case (i+1)%100 == 0:
						_ = client.CommitRecords(context.WithoutCancel(ctx), r)
					}
				}
			})
		})
		wg.Wait()
		if len(last) > 0 {
			_ = client.CommitRecords(context.WithoutCancel(ctx), last...)
		}
		client.AllowRebalance()
	}
}

func (w *world) produceN(b *testing.B, n int) {
	b.Helper()
	rs := make([]*kgo.Record, n)
	for i := range rs {
		rs[i] = rec(fmt.Sprintf("m-%d", i), fmt.Sprintf("acct-%d", i%5), "100")
	}
	w.produce(b, "credits", rs...)
}
