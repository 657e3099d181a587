// Package idempotencykafka applies the records of a Kafka consumer group at
// most once each, on franz-go (github.com/twmb/franz-go) and the
// idempotency engine: every record's effect commits in one PostgreSQL
// transaction with its message ID, and the record's offset is committed to
// Kafka only after that transaction committed. A record delivered again
// (after a crash between the two commits, a rebalance) finds its ID and is
// skipped; a record that can never succeed is produced to a dead-letter
// topic with its cause, then committed, so that it never blocks its
// partition or comes back forever.
//
// A producer's own re-send of a record is found only when the producer
// gives both sends the same ID in the message-id header ([WithIDHeader]):
// without it the re-send is a record of its own, at its own position, and
// is applied again. (franz-go's idempotent producer dedupes its internal
// retries on the broker; an application's re-send after a timeout needs the
// header.) IDs that are not valid keys are recorded hashed; an empty one is
// no ID.
//
// It is a module of its own, so that the core library's go.mod has no
// Kafka client.
//
//	client, err := kgo.NewClient(
//		kgo.SeedBrokers(brokers...),
//		kgo.ConsumerGroup("credits"),
//		kgo.ConsumeTopics("payments"),
//		kgo.DisableAutoCommit(),                                 // required: offsets follow the database
//		kgo.FetchIsolationLevel(kgo.ReadCommitted()),            // required: no record of an aborted transaction
//		kgo.KeepControlRecords(),                                // required: offsets committed past transaction markers
//		kgo.BlockRebalanceOnPoll(),                              // required: no partition revoked mid-poll
//		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked), // recommended: a rebalance never waits for a record's retries
//	)
//	c, err := idempotencykafka.New(store, client, func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
//		_, err := tx.Exec(ctx, `INSERT INTO credits (account, cents) VALUES ($1, $2)`, r.Key, r.Value)
//		return err
//	})
//	err = c.Run(ctx)
package idempotencykafka

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
)

// Handler applies one record's effect through tx, the transaction that
// also records the record's ID. An error rolls everything back; the record
// is tried again, up to the consumer's attempts, then dead-lettered. An
// error marked with idempotency.Final (a record that can never be
// applied) is stored with the ID and dead-letters the record at once.
type Handler func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error

// Consumer applies polled records through a Handler, at most once per
// message ID, and commits offsets behind the database.
type Consumer struct {
	store  *idempotency.Store
	client *kgo.Client
	handle Handler
	o      options

	mu       sync.Mutex
	inFlight map[topicPartition]context.CancelCauseFunc // see OnPartitionsLost
	lost     map[topicPartition]bool                    // since the poll began
	inCommit map[topicPartition]context.CancelFunc      // commits under way
	hurried  chan struct{}                              // closed when a rebalance waits for this poll (OnPartitionsCallbackBlocked)
	ret      retention
}

// New returns a consumer of client's group. The client must consume as a
// group (kgo.ConsumerGroup) with kgo.DisableAutoCommit, so that no offset
// is committed ahead of the database, read committed records only
// (kgo.FetchIsolationLevel(kgo.ReadCommitted())), so that no record of an
// aborted transaction is applied, and keep transaction markers
// (kgo.KeepControlRecords), so that offsets are committed past them and a
// transactional partition's lag reaches 0, and block rebalances while a
// poll's records are applied (kgo.BlockRebalanceOnPoll), so that no commit
// of offsets lands on a partition that has moved since the poll; its
// kgo.OnPartitionsCallbackBlocked is best [OnPartitionsCallbackBlocked],
// so that a rebalance never waits for a record that waits. The client is
// the caller's to close, after Run returned; one Run polls it at a time.
func New(store *idempotency.Store, client *kgo.Client, handle Handler, opts ...Option) (*Consumer, error) {
	if store == nil || client == nil || handle == nil {
		return nil, errors.New("idempotencykafka: New needs a store, a client and a handler")
	}
	group, _ := client.OptValue(kgo.ConsumerGroup).(string)
	if group == "" {
		return nil, errors.New("idempotencykafka: the client consumes no consumer group: set kgo.ConsumerGroup")
	}
	if autoOff, _ := client.OptValue(kgo.DisableAutoCommit).(bool); !autoOff {
		return nil, errors.New("idempotencykafka: the client commits offsets on its own, possibly ahead of the database: set kgo.DisableAutoCommit")
	}
	if !readsCommitted(client) {
		return nil, errors.New("idempotencykafka: the client reads the records of aborted transactions (franz-go's default), which would be applied as if produced: " +
			"set kgo.FetchIsolationLevel(kgo.ReadCommitted())")
	}
	if blocks, _ := client.OptValue(kgo.BlockRebalanceOnPoll).(bool); !blocks {
		return nil, errors.New("idempotencykafka: the client lets the group revoke partitions while a poll's records are being applied, after which this member's commit of their offsets can land over their new owner's and set them back: " +
			"set kgo.BlockRebalanceOnPoll() (and kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked), so that a poll a rebalance waits for ends soon)")
	}
	if keeps, _ := client.OptValue(kgo.KeepControlRecords).(bool); !keeps {
		return nil, errors.New("idempotencykafka: the client hides transaction markers, so no offset can be committed past one and a transactional partition's lag never reaches 0: " +
			"set kgo.KeepControlRecords() (the consumer skips them itself)")
	}
	o := defaultOptions(group)
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	// A scope the store refuses would fail every record, retried forever:
	// refused here, for every topic the client names.
	// A regex, or topics added later, may bring a topic of the longest name
	// Kafka allows. So is a dead-letter topic that can never exist, for the
	// topics the client names.
	var named []string
	if regex, _ := client.OptValue(kgo.ConsumeRegex).(bool); !regex {
		named, _ = client.OptValue(kgo.ConsumeTopics).([]string)
	}
	for _, topic := range append([]string{strings.Repeat("t", maxTopicLen)}, named...) {
		if err := idempotency.ValidateScope(o.scope(topic)); err != nil {
			return nil, fmt.Errorf("idempotencykafka: WithScope: for topic %.40q: %w (the scope must leave room for topic names of %d characters)", topic, err, maxTopicLen)
		}
	}
	for _, topic := range named {
		if dl := o.deadLetterTopic(topic); !validTopic(dl) {
			return nil, fmt.Errorf("idempotencykafka: WithDeadLetterTopic: %.60q, the dead-letter topic of %.40q, is not a valid topic name (1 to %d of a-z, A-Z, 0-9, '.', '_', '-')", dl, topic, maxTopicLen)
		}
	}
	c := &Consumer{store: store, client: client, handle: handle, o: o, inFlight: map[topicPartition]context.CancelCauseFunc{}, lost: map[topicPartition]bool{}, inCommit: map[topicPartition]context.CancelFunc{}, hurried: make(chan struct{})}
	c.ret.topics = map[string]*topicTTL{}
	register(c)
	return c, nil
}

// Run polls records, applies them (partitions at once, each partition's
// records in offset order), produces the ones that can never succeed to the
// dead-letter topic, commits the offsets of the records done, and allows
// the next rebalance, until ctx is done; it then returns ctx.Err(). Stop it
// by cancelling ctx, then close the client: a record being retried (the
// database down, its ID held elsewhere, the dead-letter topic missing)
// stops only with ctx or a rebalance ([OnPartitionsCallbackBlocked]), and
// the client's Close waits for Run to allow the rebalance (with
// kgo.BlockRebalanceOnPoll). Run refuses to start while another Run polls
// the same client: each would commit offsets past records the other has
// not applied yet. A client closed under Run
// with CloseAllowingRebalance ends it (nil) at its next poll; a Run
// stopped with records polled sets the client back to them, so that a Run
// started again on the client is delivered them. A failed offset commit is
// reported to WithErrorHandler and tried again, with backoff, until it
// succeeds or the group moved the partition (whose new owner reads the
// records again and replays them); one refused for a rebalance in progress
// once the poll's records are all done is given up, so that the rebalance
// goes ahead, and the records are delivered again (see ProcessFetches).
// Run returns the refusal of a TTL ([Consumer.CheckRetention]) when it
// starts, and when a topic's retention raised while it runs makes WithTTL
// too short, before any record of the topic is applied with it.
func (c *Consumer) Run(ctx context.Context) error {
	if !polling.take(c.client) {
		return errors.New("idempotencykafka: Run: another Run polls this client: the records of one client are polled by one Run at a time " +
			"(two would each commit offsets past records the other has not applied yet); give each Run a client of its own")
	}
	defer polling.release(c.client)
	for wait := uint(0); ; wait++ {
		err := c.CheckRetention(ctx)
		if err == nil {
			break
		}
		if c.permanent(err) || ctx.Err() != nil {
			return err
		}
		// The configs could not be read, for a reason that may pass (a
		// timeout, the brokers starting): read them again.
		c.o.onError(fmt.Errorf("%w; trying again", err))
		if err := sleep(ctx, c.o.backoff(wait, nil)); err != nil {
			return err
		}
	}
	for failed := uint(0); ; {
		if err := c.recheckRetention(ctx); err != nil {
			return err
		}
		c.newPoll()
		fetches, idle := c.poll(ctx)
		if idle {
			continue
		}
		if fetches.IsClientClosed() {
			return nil
		}
		if ctx.Err() != nil {
			// Stopping with records polled and none applied: the client
			// has fetched past them, and a Run started again on it would
			// be delivered the records after them.
			for _, p := range byPartition(fetches) {
				c.rewind(p.Records[0])
			}
			c.client.AllowRebalance()
			return ctx.Err()
		}
		fetches.EachError(func(topic string, partition int32, err error) {
			c.o.onError(fmt.Errorf("idempotencykafka: fetch %s/%d: %w", topic, partition, err))
		})
		err := c.processFetches(ctx, fetches)
		c.client.AllowRebalance()
		if err == nil {
			failed = 0
			continue
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if c.permanent(err) {
			// A TTL refused since the start (a topic's retention raised
			// past WithTTL, a topic a regex matched): as at the start.
			return err
		}
		c.o.onError(err)
		if errors.Is(err, errHurried) {
			// The poll ended for a rebalance: the next poll is of the
			// member's new assignment, with nothing to wait for.
			failed = 0
			continue
		}
		// A commit given up (a rebalance, say) delivers the poll's
		// records again: replayed at once, they would meet the same
		// refusal as fast as the broker answers.
		if err := sleep(ctx, c.o.backoff(failed, nil)); err != nil {
			return err
		}
		failed++
	}
}

// poll is one PollRecords of Run, which wakes the client's fetch loops
// first and ends after fetchWake without records (idle; the rebalance it
// held is allowed), for Run to wake them again. franz-go (1.22.3) can lose
// a broker's fetch loop: a loop that begins as the consumer session
// restarts (SetOffsets, which rewind calls, or a rebalance) takes the old
// session, finds it ended and stops, dropping the new session's call to
// fetch. The broker's partitions, usable and behind their ends, are then
// never fetched again, and a poll that waits for them waits forever.
// ResumeFetchTopics with no topic resumes nothing and starts every
// broker's loop that is not running.
func (c *Consumer) poll(ctx context.Context) (fetches kgo.Fetches, idle bool) {
	c.client.ResumeFetchTopics()
	wctx, cancel := context.WithTimeout(ctx, fetchWake)
	defer cancel()
	fetches = c.client.PollRecords(wctx, c.o.maxPollRecords)
	if ctx.Err() != nil || fetches.NumRecords() > 0 || !errors.Is(fetches.Err0(), context.DeadlineExceeded) || wctx.Err() == nil {
		return fetches, false
	}
	// The fetch of wctx's error holds rebalances as a poll does.
	c.client.AllowRebalance()
	return nil, true
}

// fetchWake is how long Run's poll waits for records before it wakes the
// client's fetch loops again (see poll).
const fetchWake = time.Second

// ProcessFetches applies the records of one poll and commits the offsets
// of those done, for a poll loop of the caller's own (one at a time per
// client; it calls AllowRebalance once ProcessFetches returned). It returns when
// every record is done or ctx is done; a record is done when its effect
// committed, now or before, or it was produced to the dead-letter topic. A
// record is never skipped: while the database is down, or another member
// holds the record's ID during a rebalance, it is tried again. The offsets
// of the poll's last records are committed in one request once every
// partition is done, or a second after the first was done while others
// still work (and a partition's every [WithCommitEvery] records on the
// way). A partition whose records it left undone (moved, stopping), or
// whose offsets it could not commit (a commit given up for a rebalance), is
// set back to the first of them, so that the client, if it keeps the
// partition, delivers them again rather than the records after them (they
// are replayed). Once a rebalance waits for the poll
// ([OnPartitionsCallbackBlocked]), records stop waiting and are left
// undone. The error joins the failed offset commits, ctx's error, and
// the refusal of a topic's TTL ([Consumer.CheckRetention]: its records
// are left undone, never applied with IDs kept too short; stop the loop
// and tell the operator). franz-go can lose a broker's fetch loop when
// SetOffsets, which sets a partition back, restarts the client's consumer
// session: a loop of one's own calls client.ResumeFetchTopics() (no
// topic) before each poll, and polls with a deadline, as Run does.
func (c *Consumer) ProcessFetches(ctx context.Context, fetches kgo.Fetches) error {
	// A partition lost before this call (between the caller's poll and
	// it, a loop that allowed the rebalance early) is lost to it: its
	// offsets are not committed. Losses are forgotten once the poll is done; Run,
	// which knows when it polls, forgets them before each poll.
	defer c.newPoll()
	if !polling.take(c.client) {
		// A Run, or another ProcessFetches, applies this client's records:
		// each would commit offsets past records the other has not applied
		// yet. These are left for later polls.
		for _, p := range byPartition(fetches) {
			c.rewind(p.Records[0])
		}
		return errors.New("idempotencykafka: ProcessFetches: a Run or another ProcessFetches applies this client's records; the records of one client are applied by one poll loop at a time (give each a client of its own); these records are delivered again")
	}
	defer polling.release(c.client)
	return c.processFetches(ctx, fetches)
}

func (c *Consumer) processFetches(ctx context.Context, fetches kgo.Fetches) error {
	type finished struct {
		done partitionDone
		err  error
	}
	partitions := byPartition(fetches)
	results := make(chan finished, len(partitions))
	var running atomic.Int64 // partitions still applying records
	running.Store(int64(len(partitions)))
	allDone := func() bool { return running.Load() == 0 }
	// waits ends every wait of the poll (a record tried again, a commit
	// retried) once a rebalance waits for the poll: see
	// OnPartitionsCallbackBlocked.
	waits, stopWaits := context.WithCancelCause(ctx)
	defer stopWaits(nil)
	go func() {
		select {
		case <-c.hurry():
			stopWaits(errHurried)
		case <-waits.Done():
		}
	}()
	for _, p := range partitions {
		go func() {
			pctx, end := c.partitionContext(ctx, p)
			defer end()
			pwaits, stop := context.WithCancelCause(waits)
			defer stop(nil)
			defer context.AfterFunc(pctx, func() { stop(context.Cause(pctx)) })()
			done, err := c.processPartition(pctx, pwaits, p.Records)
			if ctx.Err() == nil && pctx.Err() != nil {
				// Lost: its offsets are not the member's to commit, nor its
				// position to set.
				done, err = partitionDone{}, context.Cause(pctx)
			}
			running.Add(-1)
			if done.last == nil || c.o.commitPerPartition {
				err = errors.Join(err, c.settle(ctx, waits, allDone, done))
				done = partitionDone{}
			}
			results <- finished{done, err}
		}()
	}
	// The offsets of partitions done go in one commit: at the end of the
	// poll, or pollCommitWait after the first of them was done while
	// others still work (a record waiting for a downstream service, say),
	// so that a partition's lag shows what is applied.
	var (
		errs    []error
		pending []partitionDone
		flush   <-chan time.Time
	)
	commit := func() {
		if len(pending) > 0 {
			errs = append(errs, c.settle(ctx, waits, allDone, pending...))
			pending = nil
		}
		flush = nil
	}
	for received := 0; received < len(partitions); {
		select {
		case f := <-results:
			received++
			if f.err != nil {
				errs = append(errs, f.err)
			}
			if f.done.last != nil {
				pending = append(pending, f.done)
				if flush == nil {
					flush = time.After(pollCommitWait)
				}
			}
		case <-flush:
			commit()
		}
	}
	commit()
	return errors.Join(errs...)
}

// pollCommitWait is how long the offsets of a poll's partitions that are
// done wait for the others, to be committed with theirs in one request.
const pollCommitWait = time.Second

// partitionDone is how far a poll got in one partition.
type partitionDone struct {
	// from is the first of the partition's records whose offset the poll
	// has not committed; last is the last record done whose offset is not
	// committed yet (nil: none); undone is the first record not done, when
	// the poll stopped before the end (nil: none).
	from, last, undone *kgo.Record
}

// processPartition applies records in order, committing the offset after
// every commitEvery records done. A record waiting to be tried again stops
// with waits.
func (c *Consumer) processPartition(ctx, waits context.Context, records []*kgo.Record) (partitionDone, error) {
	d := partitionDone{from: records[0]}
	for i, r := range records {
		if r.Attrs.IsControl() {
			// A transaction's commit or abort marker: nothing to apply, but
			// an offset to commit past (Kafka's consumers do), or the
			// partition's lag would stay at 1.
			d.last = r
			continue
		}
		if waits.Err() != nil {
			// A rebalance waits for the poll (or the partition was lost):
			// no record begins; this one and those after it are delivered
			// again.
			d.undone = r
			return d, context.Cause(waits)
		}
		if err := c.processRecord(ctx, waits, r); err != nil {
			d.undone = r
			return d, err
		}
		d.last = r
		if (i+1)%c.o.commitEvery == 0 && i+1 < len(records) {
			// In the middle of the partition's records: no rebalance can
			// take it before they are done (kgo.BlockRebalanceOnPoll).
			if _, err := c.commit(ctx, waits, func() bool { return false }, d.last); err != nil {
				// Applied, not committed: a later offset's commit covers
				// them. The records after them are delivered again.
				return partitionDone{from: records[i+1], undone: records[i+1]}, err
			}
			d = partitionDone{from: records[i+1]}
		}
	}
	return d, nil
}

// settle commits the offsets after each of ds's last records, in one
// request, and sets each partition back where its records are to be
// delivered again: to the first record not done when the commit went
// through (or there was nothing to commit), to the first record whose
// offset is not committed when it did not. A record is so never skipped
// by the client that keeps, or gets back, its partition. Called before the
// poll allows a rebalance.
func (c *Consumer) settle(ctx, waits context.Context, allDone func() bool, ds ...partitionDone) error {
	var rs []*kgo.Record
	for _, d := range ds {
		if d.last != nil {
			rs = append(rs, d.last)
		}
	}
	committed, err := true, error(nil)
	if len(rs) > 0 {
		committed, err = c.commit(ctx, waits, allDone, rs...)
	}
	for _, d := range ds {
		switch {
		case !committed && d.last != nil:
			c.rewind(d.from)
		case d.undone != nil:
			c.rewind(d.undone)
		}
	}
	return err
}

// byPartition is the poll's records, one entry per partition in offset
// order: a poll can hold several fetches of one partition, and a
// partition's records are applied by one goroutine, in order.
func byPartition(fetches kgo.Fetches) []kgo.FetchTopicPartition {
	var out []kgo.FetchTopicPartition
	at := map[topicPartition]int{}
	fetches.EachPartition(func(p kgo.FetchTopicPartition) {
		if len(p.Records) == 0 {
			return
		}
		tp := topicPartition{p.Topic, p.Partition}
		i, seen := at[tp]
		if !seen {
			at[tp] = len(out)
			p.Records = slices.Clone(p.Records)
			out = append(out, p)
			return
		}
		out[i].Records = append(out[i].Records, p.Records...)
	})
	for _, p := range out {
		slices.SortStableFunc(p.Records, func(a, b *kgo.Record) int { return cmp.Compare(a.Offset, b.Offset) })
	}
	return out
}

// rewind sets the client's position in r's partition back to r, which the
// poll did not get through (the partition was lost or moved, a commit
// failed for good or was given up, the consumer is stopping). The client
// has fetched past it; were the member to keep the partition, or get it
// back, its next poll would deliver the records after r, and their
// offsets, committed, would skip r and the ones after it that nobody
// applied. A partition lost during the poll, or that the client no longer
// consumes, is left alone: its next owner starts at the committed offset.
// Called before the poll allows a rebalance.
func (c *Consumer) rewind(r *kgo.Record) {
	if len(c.notLost([]*kgo.Record{r})) == 0 {
		return
	}
	c.client.SetOffsets(map[string]map[int32]kgo.EpochOffset{r.Topic: {r.Partition: {Epoch: r.LeaderEpoch, Offset: r.Offset}}})
}

// commit commits the offsets after rs (one per partition), on a context
// of its own: what committed in the database should reach Kafka even when
// the consumer is stopping. committed says the offsets of rs's partitions
// that are not lost went through; err tells of the ones that did not, and
// of lost partitions left out.
//
// A failed commit is tried again, with backoff, until it succeeds: a
// committed offset that stays behind means a lag that never clears and
// records read again at every restart. It stops when the group moved the
// partition (the member's generation is over: the new owner reads the
// records again and replays them), when ctx is done and a last try
// within the commit timeout failed, or when waits ends (a rebalance waits
// for the poll).
//
// A rebalance in progress is waited for while records of the poll are
// still being applied (no partition can be revoked then, with
// kgo.BlockRebalanceOnPoll). Once allDone says every record of the poll
// is done, the commit is given up instead, so that the poll ends and
// allows the rebalance: no commit of the poll is ever sent after that, as
// the partitions may be another member's by then, and a commit accepted
// in the member's next generation would set their offsets back below the
// new owner's. The records are delivered again (settle) where the member
// keeps the partition, and replayed; the new owner replays them where it
// does not.
func (c *Consumer) commit(ctx, waits context.Context, allDone func() bool, rs ...*kgo.Record) (committed bool, err error) {
	var moved error
	for wait := uint(0); ; wait++ {
		if kept := c.notLost(rs); len(kept) < len(rs) {
			moved = fmt.Errorf("idempotencykafka: the offsets of lost partitions are not committed: %s", positions(lostOnes(rs, kept)))
			if rs = kept; len(rs) == 0 {
				return true, moved
			}
		}
		cctx, cancel := c.commitContext(ctx, rs)
		err := c.client.CommitRecords(cctx, rs...)
		cancel()
		if err == nil {
			return true, moved
		}
		if len(c.notLost(rs)) < len(rs) {
			continue // a partition was lost during the commit (franz-go's own retries cut): without it
		}
		err = fmt.Errorf("idempotencykafka: commit offsets %s: %w", positions(rs), err)
		if ctx.Err() != nil || partitionMoved(err) {
			return false, errors.Join(moved, err)
		}
		if errors.Is(err, kerr.RebalanceInProgress) && allDone() {
			return false, errors.Join(moved, fmt.Errorf("%w; given up, so that the rebalance goes ahead: the records are delivered again", err))
		}
		c.o.onError(fmt.Errorf("%w; trying again", err))
		if err := sleep(waits, c.o.backoff(wait, nil)); err != nil {
			return false, errors.Join(moved, fmt.Errorf("idempotencykafka: commit offsets %s: given up before it succeeded (%w): the records are delivered again", positions(rs), err))
		}
	}
}

// lostOnes is rs without kept, which notLost kept of rs.
func lostOnes(rs, kept []*kgo.Record) []*kgo.Record {
	var out []*kgo.Record
	for _, r := range rs {
		if !slices.Contains(kept, r) {
			out = append(out, r)
		}
	}
	return out
}

// positions names the offsets after rs: "topic/partition@offset, ...".
func positions(rs []*kgo.Record) string {
	var b strings.Builder
	for i, r := range rs {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s/%d@%d", r.Topic, r.Partition, r.Offset+1)
	}
	return b.String()
}

// partitionMoved reports whether a commit failed because the member's
// generation in the group is over: its partitions are another member's.
func partitionMoved(err error) bool {
	for _, e := range []*kerr.Error{kerr.IllegalGeneration, kerr.UnknownMemberID, kerr.FencedInstanceID, kerr.StaleMemberEpoch, kerr.UnknownTopicOrPartition} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// processRecord applies r until it is done, or ctx is done (an attempt
// under way is cut), or waits is done (a rebalance waits for the poll: an
// attempt under way ends, no other begins). A record not done is
// delivered again.
func (c *Consumer) processRecord(ctx, waits context.Context, r *kgo.Record) error {
	if _, omitted := lastHeader(r, HeaderValueOmitted); omitted && isDeadLetter(r) {
		// A pointer to a record, not the record: never applied.
		c.o.onError(fmt.Errorf("idempotencykafka: %s/%d@%d is a dead letter without its record's value: it is not applied", r.Topic, r.Partition, r.Offset))
		return nil
	}
	m, err := c.Message(waits, r)
	for wait := uint(0); err != nil; wait++ {
		if c.permanent(err) {
			// The topic's retention is longer than WithTTL (raised since
			// the start, or a topic a regex matched since): the record is
			// never applied with an ID that could be forgotten too soon,
			// and the refusal is the operator's to read.
			return fmt.Errorf("idempotencykafka: %s/%d@%d is not applied: %w", r.Topic, r.Partition, r.Offset, err)
		}
		// The topic's retention cannot be read: the record waits for it.
		c.o.onError(fmt.Errorf("idempotencykafka: %s/%d@%d waits: %w", r.Topic, r.Partition, r.Offset, err))
		if err := sleep(waits, c.o.backoff(wait, nil)); err != nil {
			return context.Cause(waits)
		}
		m, err = c.Message(waits, r)
	}
	id := m.ID
	fn := func(ctx context.Context, tx pgx.Tx) error { return c.handle(ctx, tx, r) }
	failures, givingUp := 0, false
	for wait := uint(0); ; wait++ {
		tctx, begin, done := try(ctx, waits)
		outcome, err := c.apply(tctx, m, func(ctx context.Context, tx pgx.Tx) error {
			if !begin() {
				return context.Cause(waits)
			}
			return fn(ctx, tx)
		})
		if done() {
			// A rebalance waits for the poll: this try ended before its
			// handler began (nothing ran, nothing counts); the record is
			// delivered again.
			return context.Cause(waits)
		}
		if givingUp && outcome == idempotency.OutcomeExecuted {
			// The giving up is stored; the handlers were told of the last
			// try, released, and the dead letter says so.
			outcome = idempotency.OutcomeReleased
		} else {
			c.o.onOutcome(r, outcome, err)
		}
		switch idempotency.DispositionOf(outcome, err) {
		case idempotency.Ack:
			return nil
		case idempotency.DeadLetter:
			return c.deadLetter(waits, r, id, outcome, err.Error())
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if outcome == idempotency.OutcomeReleased && !transient(err) && !c.o.retryable(err) {
			// The handler's own error: the record is tried a bounded number
			// of times. The database being down or overloaded, a lock or
			// serialization conflict, or the ID held by another member, are
			// not the record's fault: those wait.
			if failures++; failures >= c.o.maxAttempts {
				// Giving up is stored as the ID's final error, like a
				// handler's Final: a redelivery (the offset commit failed,
				// the consumer died before it) is dead-lettered again and
				// never applied after the records that came after it.
				// Storing it waits for the database as a try does.
				gaveUp := fmt.Errorf("gave up after %d attempts: %s", failures, cut(err.Error(), maxCause))
				fn = func(context.Context, pgx.Tx) error { return idempotency.Final(gaveUp) }
				givingUp = true
				continue
			}
		}
		if err := sleep(waits, c.o.backoff(wait, err)); err != nil {
			return context.Cause(waits)
		}
	}
}

// apply is ProcessMessage, with a panic of the handler turned into an
// error: the engine has rolled the record's transaction back and released
// its ID, and a record that panics every time is dead-lettered after its
// attempts rather than crashing every consumer it reaches.
func (c *Consumer) apply(ctx context.Context, m idempotency.Message, fn func(context.Context, pgx.Tx) error) (outcome idempotency.Outcome, err error) {
	defer func() {
		if p := recover(); p != nil {
			outcome, err = idempotency.OutcomeReleased, fmt.Errorf("the handler panicked: %v", p)
			c.o.onError(fmt.Errorf("idempotencykafka: message %s: %w\n%s", m.ID, err, debug.Stack()))
		}
	}()
	return c.store.ProcessMessage(ctx, m, fn)
}

// try is the context of one try of a record: ctx, and also ended by
// waits (a rebalance waits for the poll) until the record's handler
// begins, so that a try waiting for its ID held by another member stops
// then, while one whose handler runs is let finish (its effect committed
// or rolled back). begin, called as the handler begins, says whether it
// may; done ends the try and says whether waits ended it before its
// handler began.
func try(ctx, waits context.Context) (tctx context.Context, begin func() bool, done func() (cut bool)) {
	tctx, cancel := context.WithCancelCause(ctx)
	var (
		mu               sync.Mutex
		running, stopped bool
	)
	stop := context.AfterFunc(waits, func() {
		mu.Lock()
		defer mu.Unlock()
		if !running {
			stopped = true
			cancel(context.Cause(waits))
		}
	})
	begin = func() bool {
		mu.Lock()
		defer mu.Unlock()
		running = !stopped
		return running
	}
	done = func() bool {
		stop()
		cancel(nil)
		mu.Lock()
		defer mu.Unlock()
		return stopped
	}
	return tctx, begin, done
}

// transient reports whether a released record's error is the database's
// (down, overloaded, a lock or statement timeout, a serialization failure
// or deadlock): trying again can help, and the record is not at fault.
func transient(err error) bool {
	return idempotency.IsDatabaseTrouble(err)
}

// Message is what the consumer processes r as: its ID (the producer's ID
// header, or the record's position), the consumer's scope, a body of the
// record's key and value, so that an ID reused for another record is
// caught, and the TTL of its topic's IDs (see [Consumer.CheckRetention]:
// the topic's configs are read the first time, and a TTL that cannot be
// established is an error), longer by as much as r's timestamp is ahead of
// now (Kafka keeps a record until its timestamp is past retention.ms). Code that applies a record outside the
// consumer gives this Message to Store.ProcessMessage, so that the two
// never both apply it.
func (c *Consumer) Message(ctx context.Context, r *kgo.Record) (idempotency.Message, error) {
	topic, pos := c.origin(r)
	ttl, err := c.ttlOf(ctx, topic)
	if errors.Is(err, kerr.UnknownTopicOrPartition) && topic != r.Topic {
		// A dead letter of a topic deleted since: its records are never
		// read again there, and the dead letter's own topic is what can
		// deliver it again.
		ttl, err = c.ttlOf(ctx, r.Topic)
	}
	if err != nil {
		return idempotency.Message{}, err
	}
	// Kafka deletes a record once its timestamp is past retention.ms: one
	// stamped ahead of now (a producer's clock ahead, a timestamp it set)
	// is kept that much longer.
	if ahead := r.Timestamp.Sub(c.o.now()); ahead > 0 {
		ttl = min(ttl, maxTTL-ahead) + ahead
	}
	return idempotency.Message{Scope: c.o.scope(topic), ID: c.idOf(r.Headers, pos), Body: body(r), TTL: ttl}, nil
}

// maxTTL is the longest TTL a Message gets: a timestamp in the far future
// (Kafka keeps its record as long) saturates there.
const maxTTL = time.Duration(1<<63 - 1)

// messageID is the producer's ID header, or the record's position (hashed
// when a long topic name would make it longer than a key may be).
//
// The two never meet: a position is "<topic>/<partition>/<offset>" or
// "position-<hex>", and a topic name has no ':'. A producer ID that is not a
// valid key, or that could be read as a position, or that begins with "id:",
// is recorded as "id:" and its SHA-256 in hex, which no position and no
// other producer ID can be; every other producer ID is recorded as it is.
// An empty ID is no ID: the record is identified by its position. A
// record Redrive produced without the consumer's ID header is identified
// by the position of the record it applies again ([HeaderRedrivenFrom]):
// every group that reads the copy takes it for the original, whatever ID
// header it reads.
func (c *Consumer) messageID(r *kgo.Record) string {
	_, pos := c.origin(r)
	return c.idOf(r.Headers, pos)
}

// idOf is the ID of a record with headers, at (or taken for the record at)
// position pos.
func (c *Consumer) idOf(headers []kgo.RecordHeader, pos string) string {
	for _, h := range headers {
		if h.Key == c.o.idHeader && len(h.Value) > 0 {
			return producerID(string(h.Value))
		}
	}
	if len(pos) > idempotency.MaxKeyLen {
		sum := sha256.Sum256([]byte(pos))
		pos = "position-" + hex.EncodeToString(sum[:])
	}
	return pos
}

// origin is the topic and the position ("topic/partition/offset") of the
// record r stands for: a dead letter's original (a dead letter is its
// record, read from elsewhere: a group that applied the record, or gave it
// up, never applies its dead letter again); a redriven copy's original
// ([HeaderRedrivenFrom]); else r itself. Headers no dead-lettering or
// Redrive could have set are not taken: dead-letter headers on a record
// outside the dead-letter topic of the topic they name, a redriven-from
// header naming another topic or a position not before the copy in its
// partition.
func (c *Consumer) origin(r *kgo.Record) (topic, pos string) {
	topic, pos = r.Topic, position(r.Topic, int64(r.Partition), r.Offset)
	if t, _ := lastHeader(r, HeaderTopic); isDeadLetter(r) && t != r.Topic && c.o.deadLetterTopic(t) == r.Topic {
		p, _ := lastHeader(r, HeaderPartition)
		o, _ := lastHeader(r, HeaderOffset)
		if dl, ok := parsePosition(t + "/" + p + "/" + o); ok {
			topic, pos = t, dl.String()
			if from, ok := redrivenFromOf(r, dl); ok {
				pos = from
			}
		}
		return topic, pos
	}
	if from, ok := redrivenFromOf(r, recordPosition{r.Topic, r.Partition, r.Offset}); ok {
		pos = from
	}
	return topic, pos
}

// redrivenFromOf is the original's position r's last HeaderRedrivenFrom
// names, if a Redrive could have set it on a copy at at.
func redrivenFromOf(r *kgo.Record, at recordPosition) (string, bool) {
	v, ok := lastHeader(r, HeaderRedrivenFrom)
	if !ok {
		return "", false
	}
	from, ok := parsePosition(v)
	if !ok || from.topic != at.topic || from.partition == at.partition && from.offset >= at.offset {
		return "", false
	}
	return from.String(), true
}

type recordPosition struct {
	topic     string
	partition int32
	offset    int64
}

func (p recordPosition) String() string { return position(p.topic, int64(p.partition), p.offset) }

func position(topic string, partition, offset int64) string {
	return topic + "/" + strconv.FormatInt(partition, 10) + "/" + strconv.FormatInt(offset, 10)
}

// parsePosition parses "topic/partition/offset" of a valid topic.
func parsePosition(v string) (recordPosition, bool) {
	i := strings.LastIndexByte(v, '/')
	j := strings.LastIndexByte(v[:max(i, 0)], '/')
	if i < 0 || j < 0 || !validTopic(v[:j]) {
		return recordPosition{}, false
	}
	p, err1 := strconv.ParseInt(v[j+1:i], 10, 32)
	o, err2 := strconv.ParseInt(v[i+1:], 10, 64)
	if err1 != nil || err2 != nil || p < 0 || o < 0 {
		return recordPosition{}, false
	}
	return recordPosition{v[:j], int32(p), o}, true
}

// lastHeader is the value of r's last header named key: the dead-letter
// headers follow the record's own, so a record's own header of that name
// never stands in for them.
func lastHeader(r *kgo.Record, key string) (string, bool) {
	for i := len(r.Headers) - 1; i >= 0; i-- {
		if r.Headers[i].Key == key {
			return string(r.Headers[i].Value), true
		}
	}
	return "", false
}

// readsCommitted reports whether the client reads committed records only.
// franz-go's OptValue gives the level as it keeps it, an int8 (1 is read
// committed, Kafka's isolation_level), or as the option's own type.
func readsCommitted(client *kgo.Client) bool {
	switch v := client.OptValue(kgo.FetchIsolationLevel).(type) {
	case kgo.IsolationLevel:
		return v == kgo.ReadCommitted()
	case int8:
		return v == 1
	}
	return false
}

// producerID is the recorded form of a producer's ID (see messageID).
func producerID(id string) string {
	if idempotency.ValidateKey(id) == nil && !looksLikePosition(id) && !strings.HasPrefix(id, "id:") {
		return id
	}
	sum := sha256.Sum256([]byte(id))
	return "id:" + hex.EncodeToString(sum[:])
}

// looksLikePosition reports whether id has the form of a position.
func looksLikePosition(id string) bool {
	if strings.HasPrefix(id, "position-") {
		return true
	}
	parts := strings.Split(id, "/")
	if len(parts) != 3 || parts[0] == "" {
		return false
	}
	for _, p := range parts[1:] {
		if _, err := strconv.ParseInt(p, 10, 64); err != nil {
			return false
		}
	}
	return true
}

// body is what the record's ID is fingerprinted with: its key and value.
func body(r *kgo.Record) []byte {
	b := binary.AppendUvarint(make([]byte, 0, binary.MaxVarintLen64+len(r.Key)+len(r.Value)), uint64(len(r.Key)))
	return append(append(b, r.Key...), r.Value...)
}

// HeaderRedrivenFrom is on a record [Consumer.Redrive] produced: the
// position ("topic/partition/offset") of the record it applies again,
// which a consumer identifies it by when it has no ID header of the
// consumer's. Only Redrive sets it.
const HeaderRedrivenFrom = "idempotency-redriven-from"

// Headers of a dead-lettered record, beside the original record's own.
const (
	HeaderCause = "idempotency-dead-letter-cause"
	// HeaderValueOmitted is on a dead letter that the broker refused whole
	// (too large): it has the record's key but not its value nor its own
	// headers, and says why; the original is at the position the other
	// headers name, for as long as the topic keeps it.
	HeaderValueOmitted = "idempotency-dead-letter-value-omitted"
	// HeaderScope is the scope the record's ID lives in, which Redrive
	// checks. (A dead letter read back, by a consumer subscribed to its
	// dead-letter topics, is identified as its record: a group that
	// applied the record, or gave it up, never applies it again.)
	HeaderScope     = "idempotency-dead-letter-scope"
	HeaderOutcome   = "idempotency-dead-letter-outcome"
	HeaderMessageID = "idempotency-dead-letter-message-id"
	HeaderTopic     = "idempotency-dead-letter-topic"
	HeaderPartition = "idempotency-dead-letter-partition"
	HeaderOffset    = "idempotency-dead-letter-offset"
)

// deadLetter produces r to the dead-letter topic with its cause, waiting
// while the produce fails (a missing topic included: reported to
// WithErrorHandler until an operator creates it), so that the record is
// committed only once it is kept there. The dead-letter topic is
// at-least-once: a consumer that dies between the produce and the offset
// commit gets the record again. One with a final error, or given up
// after its attempts (both stored with its ID), is dead-lettered again
// without running; one whose ID was reused by another record is compared
// again, and dead-lettered again.
func (c *Consumer) deadLetter(ctx context.Context, r *kgo.Record, id string, outcome idempotency.Outcome, cause string) error {
	if isDeadLetter(r) {
		// A dead letter read back (a consumer subscribed to its own
		// dead-letter topics, by a regex): producing it again would make
		// dead letters of dead letters forever. Left where it is.
		c.o.onError(fmt.Errorf("idempotencykafka: %s/%d@%d is a dead letter already and cannot be applied either (%s); it is not dead-lettered again",
			r.Topic, r.Partition, r.Offset, cause))
		c.o.onDeadLetter(r, cause)
		return nil
	}
	dl := &kgo.Record{
		Topic: c.o.deadLetterTopic(r.Topic),
		Key:   r.Key,
		Value: r.Value,
		Headers: append(append([]kgo.RecordHeader(nil), r.Headers...),
			kgo.RecordHeader{Key: HeaderCause, Value: []byte(cut(cause, maxCause))},
			kgo.RecordHeader{Key: HeaderOutcome, Value: []byte(outcome.String())},
			kgo.RecordHeader{Key: HeaderMessageID, Value: []byte(id)},
			kgo.RecordHeader{Key: HeaderScope, Value: []byte(c.o.scope(r.Topic))},
			kgo.RecordHeader{Key: HeaderTopic, Value: []byte(r.Topic)},
			kgo.RecordHeader{Key: HeaderPartition, Value: []byte(strconv.FormatInt(int64(r.Partition), 10))},
			kgo.RecordHeader{Key: HeaderOffset, Value: []byte(strconv.FormatInt(r.Offset, 10))},
		),
	}
	if !validTopic(dl.Topic) {
		// A name no broker accepts (WithDeadLetterTopic's function for a
		// topic New did not know): no produce can succeed.
		c.o.onError(fmt.Errorf("idempotencykafka: %s/%d@%d is given up without a dead letter: its dead-letter topic %.60q is not a valid topic name (fix WithDeadLetterTopic); its cause: %s",
			r.Topic, r.Partition, r.Offset, dl.Topic, cut(cause, maxCause)))
		c.o.onDeadLetter(r, cause)
		return nil
	}
	for wait := uint(0); ; wait++ {
		err := c.client.ProduceSync(ctx, dl).FirstErr()
		if err == nil {
			c.o.onDeadLetter(r, cause)
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c.o.onError(fmt.Errorf("idempotencykafka: produce %s/%d@%d to dead-letter topic %s: %w", r.Topic, r.Partition, r.Offset, dl.Topic, err))
		if neverProduced(err) {
			return c.deadLetterThatFits(ctx, r, dl, cause, err)
		}
		if err := sleep(ctx, c.o.backoff(wait, nil)); err != nil {
			return err
		}
	}
}

// deadLetterThatFits produces, for a dead letter the broker refused for
// good (too large, say), one that fits: the record's key, no value, none of
// its own headers, the dead-letter headers with the cause cut short, which
// point at the original record (topic, partition, offset) for whoever
// replays it. If even that is refused for good (the topic invalid, or not
// writable by the client), the record is given up without one, reported:
// a dead letter must never stop its partition.
func (c *Consumer) deadLetterThatFits(ctx context.Context, r *kgo.Record, dl *kgo.Record, cause string, refused error) error {
	cause = cut(cause, 1<<10)
	small := &kgo.Record{Topic: dl.Topic, Key: r.Key}
	for _, h := range dl.Headers[len(r.Headers):] {
		if h.Key == HeaderCause {
			h.Value = []byte(cause)
		}
		small.Headers = append(small.Headers, h)
	}
	small.Headers = append(small.Headers, kgo.RecordHeader{Key: HeaderValueOmitted, Value: []byte(refused.Error())})
	for wait := uint(0); ; wait++ {
		err := c.client.ProduceSync(ctx, small).FirstErr()
		switch {
		case err == nil:
			c.o.onDeadLetter(r, cause)
			return nil
		case ctx.Err() != nil:
			return ctx.Err()
		case neverProduced(err):
			c.o.onError(fmt.Errorf("idempotencykafka: %s/%d@%d is given up without a dead letter: the dead-letter topic %s refuses it for good (%w); its cause: %s",
				r.Topic, r.Partition, r.Offset, dl.Topic, err, cause))
			c.o.onDeadLetter(r, cause)
			return nil
		}
		c.o.onError(fmt.Errorf("idempotencykafka: produce the shortened dead letter of %s/%d@%d to %s: %w", r.Topic, r.Partition, r.Offset, dl.Topic, err))
		if err := sleep(ctx, c.o.backoff(wait, nil)); err != nil {
			return err
		}
	}
}

// maxCause bounds the cause a dead letter carries, and the last error a
// given-up record's ID is stored with: a handler's error can be as long as
// it likes, a record's headers cannot.
const maxCause = 4 << 10

// cut shortens s to at most n bytes and a marker, on a character boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n] + "... (cut)"
}

// maxTopicLen is the longest topic name Kafka allows.
const maxTopicLen = 249

// validTopic reports whether name is a topic name Kafka accepts.
func validTopic(name string) bool {
	if name == "" || len(name) > maxTopicLen || name == "." || name == ".." {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '.' || r == '_' || r == '-') {
			return false
		}
	}
	return true
}

// neverProduced reports whether a produce error is one no retry fixes: the
// record too large, the topic invalid, the client not authorized.
func neverProduced(err error) bool {
	for _, e := range []*kerr.Error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidTopicException, kerr.TopicAuthorizationFailed,
		kerr.ClusterAuthorizationFailed, kerr.InvalidRecord, kerr.PolicyViolation, kerr.InvalidRequiredAcks} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// Redrive applies a dead-lettered record again, once the cause that made
// it fail is fixed: it forgets the record's stored failure (its final
// error, or its giving up) and produces the record back to its topic,
// where the consumer applies it under the original's ID: the copy keeps
// the original's headers, its ID header included, and names the
// original's position ([HeaderRedrivenFrom]) for consumers that identify
// records by position. Every group that reads the copy takes it for the
// original: one that applied the original replays it.
//
// The effect stays once: the ID's record is forgotten only when it failed
// ([idempotency.Store.Forget] of state "failed"), so a Redrive repeated, or of a
// record that was applied after all, produces a copy that is replayed, or
// refuses. Another group keeps its ID of the original for its TTL from
// when it applied it: a copy it reads after that (it lags, or re-reads the
// topic, past the TTL) is a new record to it, so redrive soon after the
// cause is fixed, and give groups that share a topic a TTL with room for
// it. Redrive a dead letter with the consumer that dead-lettered it
// (its scope and ID header); another refuses it. It refuses a record
// whose ID another record took first (the dead letter's outcome
// key_reused: produce it again under a new ID), and a dead letter without
// the record's value ([HeaderValueOmitted]: produce the original, at the
// position the dead letter names, again with its ID header, after
// Forget of its ID's failure). dl is the record as read from the dead-letter
// topic.
func (c *Consumer) Redrive(ctx context.Context, dl *kgo.Record) error {
	if !isDeadLetter(dl) {
		return fmt.Errorf("idempotencykafka: redrive %s/%d@%d: not a dead letter (it has no %s header)", dl.Topic, dl.Partition, dl.Offset, HeaderCause)
	}
	h := func(key string) string { v, _ := lastHeader(dl, key); return v }
	id, topic, scope := h(HeaderMessageID), h(HeaderTopic), h(HeaderScope)
	where := topic + "/" + h(HeaderPartition) + "@" + h(HeaderOffset)
	if _, omitted := lastHeader(dl, HeaderValueOmitted); omitted {
		return fmt.Errorf("idempotencykafka: redrive %s: the dead letter has no value (%s); produce the original record at %s again, with its ID header, after Store.Forget(%q, %q, \"failed\")",
			where, HeaderValueOmitted, where, scope, "message "+id)
	}
	if h(HeaderOutcome) == idempotency.OutcomeKeyReused.String() {
		return fmt.Errorf("idempotencykafka: redrive %s: its message ID %q was taken by another record first; produce it again with a new %s header", where, id, c.o.idHeader)
	}
	if _, err := parsePosition(topic + "/" + h(HeaderPartition) + "/" + h(HeaderOffset)); !err {
		return fmt.Errorf("idempotencykafka: redrive %s/%d@%d: the dead letter's %s, %s or %s header is missing or invalid", dl.Topic, dl.Partition, dl.Offset, HeaderTopic, HeaderPartition, HeaderOffset)
	}
	if scope != c.o.scope(topic) {
		return fmt.Errorf("idempotencykafka: redrive %s: the dead letter is of scope %q, this consumer's is %q: redrive it with the consumer that dead-lettered it", where, scope, c.o.scope(topic))
	}
	// The copy: the original's headers, and the position of the record the
	// dead letter stands for (the original's, when it was a copy itself),
	// which every consumer identifies the copy by as it identified the
	// dead letter and the original.
	_, from := c.origin(dl)
	again := &kgo.Record{Topic: topic, Key: dl.Key, Value: dl.Value}
	for _, hd := range dl.Headers {
		if hd.Key != HeaderRedrivenFrom && !strings.HasPrefix(hd.Key, "idempotency-dead-letter-") {
			again.Headers = append(again.Headers, hd)
		}
	}
	again.Headers = append(again.Headers, kgo.RecordHeader{Key: HeaderRedrivenFrom, Value: []byte(from)})
	if got := c.idOf(again.Headers, from); got != id {
		return fmt.Errorf("idempotencykafka: redrive %s: this consumer identifies the record as %q, the dead letter names %q (another ID header?): redrive it with the consumer that dead-lettered it", where, got, id)
	}
	switch err := c.store.Forget(ctx, scope, "message "+id, "failed"); {
	case errors.Is(err, idempotency.ErrNotFailed):
		return fmt.Errorf("idempotencykafka: redrive %s: message %q was applied already; redriving it would apply it twice: %w", where, id, err)
	case err != nil && !errors.Is(err, idempotency.ErrKeyNotFound):
		// ErrKeyNotFound: nothing is stored (the ID expired, or a redrive
		// forgot it already and its copy is on its way): the copy carries
		// the ID, so it is applied at most once all the same.
		return fmt.Errorf("idempotencykafka: redrive %s: %w", where, err)
	}
	if err := c.client.ProduceSync(ctx, again).FirstErr(); err != nil {
		return fmt.Errorf("idempotencykafka: redrive %s: produce it to %s (its failure is forgotten: redrive it again): %w", where, topic, err)
	}
	return nil
}

// isDeadLetter reports whether r carries the headers this package gives a
// dead letter.
func isDeadLetter(r *kgo.Record) bool {
	var cause, topic bool
	for _, h := range r.Headers {
		cause = cause || h.Key == HeaderCause
		topic = topic || h.Key == HeaderTopic
	}
	return cause && topic
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// jitter is the relative jitter of every wait: ±20%.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
