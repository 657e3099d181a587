package idempotency

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DeleteExpired deletes up to limit expired keys and reports how many it
// deleted, oldest first. Cleaners on several replicas may run at once: a
// batch only ever deletes keys that are expired when it runs.
func (s *Store) DeleteExpired(ctx context.Context, limit int) (int64, error) {
	if limit <= 0 {
		return 0, fmt.Errorf("idempotency: DeleteExpired: limit must be positive, got %d", limit)
	}
	start := time.Now()
	var tag pgconn.CommandTag
	st, err := s.statements(ctx)
	if err == nil {
		err = s.readCommitted(ctx, func(tx pgx.Tx) (err error) {
			tag, err = tx.Exec(ctx, st.deleteExpired, limit)
			return err
		})
	}
	if err != nil {
		err = s.dbError(ctx, "delete expired keys", err)
	}
	if g, ok := s.opts.tracer.(*guardedTracer); ok {
		g.cleanerBatch(ctx, TraceCleanerBatchData{Deleted: tag.RowsAffected(), Duration: time.Since(start), Err: err})
	}
	return tag.RowsAffected(), err
}

// RunCleaner deletes expired keys every interval, in batches of batchSize,
// until ctx is done; then it returns ctx's error. Errors from single rounds
// are passed to onError when it is not nil, and the cleaner keeps going.
// Run it in its own goroutine; one per replica is fine.
//
// A round deletes batches until one comes back short. While a backlog lasts
// (after downtime, or a TTL shortened), it pauses between batches for nine
// times as long as the last batch took, so it spends at most a tenth of its
// time deleting and never competes hard with the calls it serves.
func (s *Store) RunCleaner(ctx context.Context, interval time.Duration, batchSize int, onError func(error)) error {
	if interval <= 0 || batchSize <= 0 {
		return fmt.Errorf("idempotency: RunCleaner: interval and batch size must be positive, got %v and %d", interval, batchSize)
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		for {
			start := time.Now()
			n, err := s.DeleteExpired(ctx, batchSize)
			if err != nil && ctx.Err() == nil && onError != nil {
				onError(err)
			}
			if err != nil || n < int64(batchSize) {
				break
			}
			pause := time.NewTimer(9 * time.Since(start))
			select {
			case <-ctx.Done():
				pause.Stop()
				return ctx.Err()
			case <-pause.C:
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}
