package idempotencykafka

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"weak"

	"github.com/twmb/franz-go/pkg/kgo"
)

// OnPartitionsLost is a kgo.OnPartitionsLost callback that stops the
// consumer's work on partitions the client lost (its member was fenced or
// kicked from the group: their records are another member's now). A
// record being applied, or waiting to be tried again, stops at once; its
// effect is then either committed or rolled back, and the new owner
// replays or applies it; the records behind it are left to the new owner,
// and no offset of a lost partition is committed. Give it to the client
// of every consumer:
//
//	kgo.OnPartitionsLost(idempotencykafka.OnPartitionsLost)
//
// With kgo.BlockRebalanceOnPoll, which New requires, franz-go calls it only
// once the poll allowed the rebalance: Run's work has ended by then
// ([OnPartitionsCallbackBlocked] ends it early). It matters to a poll loop
// of one's own that allows the rebalance before ProcessFetches returned.
func OnPartitionsLost(_ context.Context, cl *kgo.Client, lost map[string][]int32) {
	for _, c := range consumersOf(cl) {
		c.lose(lost)
	}
}

// lose stops the work of lost partitions and marks them, so that no commit
// of the poll being done takes their offsets.
func (c *Consumer) lose(lost map[string][]int32) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for topic, partitions := range lost {
		for _, p := range partitions {
			tp := topicPartition{topic, p}
			c.lost[tp] = true
			if cancel := c.inFlight[tp]; cancel != nil {
				cancel(fmt.Errorf("idempotencykafka: partition %s/%d was lost: its records are another member's", topic, p))
			}
			if cancel := c.inCommit[tp]; cancel != nil {
				cancel()
			}
		}
	}
}

// commitContext is the context of one try of a commit of rs: of its own
// (what committed in the database should reach Kafka even when the
// consumer is stopping), bounded by the commit timeout, and cancelled when
// one of rs's partitions is lost. A partition has one commit under way at
// most: its own on the way, then the poll's.
func (c *Consumer) commitContext(ctx context.Context, rs []*kgo.Record) (context.Context, context.CancelFunc) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.o.commitTimeout)
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, r := range rs {
		c.inCommit[topicPartition{r.Topic, r.Partition}] = cancel
	}
	return cctx, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, r := range rs {
			delete(c.inCommit, topicPartition{r.Topic, r.Partition})
		}
		cancel()
	}
}

// notLost returns rs without the records of partitions lost since the
// poll began.
func (c *Consumer) notLost(rs []*kgo.Record) []*kgo.Record {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.lost) == 0 {
		return rs
	}
	kept := make([]*kgo.Record, 0, len(rs))
	for _, r := range rs {
		if !c.lost[topicPartition{r.Topic, r.Partition}] {
			kept = append(kept, r)
		}
	}
	return kept
}

// newPoll forgets the partitions lost before, and a rebalance that waited
// for the poll before: a poll's records are of the member's assignment
// when it polled.
func (c *Consumer) newPoll() {
	c.mu.Lock()
	clear(c.lost)
	select {
	case <-c.hurried:
		c.hurried = make(chan struct{})
	default:
	}
	c.mu.Unlock()
}

// OnPartitionsCallbackBlocked is a kgo.OnPartitionsCallbackBlocked
// callback that ends the poll a rebalance waits for: with
// kgo.BlockRebalanceOnPoll, which New requires, a member's partitions are
// neither revoked nor reported lost while a poll's records are being
// applied, and a record that waits to be tried again (the database down,
// its ID held by another member, a handler's error WithRetryable names, a
// missing dead-letter topic) could hold the group's rebalance until the
// member is dropped from the group. Told that a rebalance waits, every
// consumer of the client stops waiting: a record whose handler runs is let
// finish (its effect committed or rolled back), a try still waiting (for
// its ID held by another member, for a retry's backoff) ends, no record
// begins, the offsets of the records done are committed, the records left
// undone are delivered again (the member may keep their partitions), and
// the poll lets the rebalance go ahead. Give it to the client of every consumer:
//
//	kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked)
func OnPartitionsCallbackBlocked(_ context.Context, cl *kgo.Client) {
	for _, c := range consumersOf(cl) {
		c.mu.Lock()
		select {
		case <-c.hurried:
		default:
			close(c.hurried)
		}
		c.mu.Unlock()
	}
}

// hurry is closed once a rebalance waits for the current poll.
func (c *Consumer) hurry() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.hurried
}

// errHurried ends the waits of a poll a rebalance waits for.
var errHurried = errors.New("idempotencykafka: a rebalance waits for the poll: the records left undone are delivered again")

type topicPartition struct {
	topic     string
	partition int32
}

// partitionContext is the context a partition's records of a poll are
// applied under: ctx, cancelled when the partition is lost. done ends it.
func (c *Consumer) partitionContext(ctx context.Context, p kgo.FetchTopicPartition) (pctx context.Context, done func()) {
	pctx, cancel := context.WithCancelCause(ctx)
	tp := topicPartition{p.Topic, p.Partition}
	c.mu.Lock()
	c.inFlight[tp] = cancel
	c.mu.Unlock()
	return pctx, func() {
		c.mu.Lock()
		delete(c.inFlight, tp)
		c.mu.Unlock()
		cancel(nil)
	}
}

// consumers finds the consumers of a client for OnPartitionsLost, which
// franz-go hands the client only. It holds the consumers weakly: one
// dropped with its client is forgotten at the next New.
var consumers = struct {
	sync.Mutex
	m map[*kgo.Client][]weak.Pointer[Consumer]
}{m: map[*kgo.Client][]weak.Pointer[Consumer]{}}

// polling holds the clients a Run polls: one Run per client.
var polling = pollers{m: map[*kgo.Client]bool{}}

type pollers struct {
	sync.Mutex
	m map[*kgo.Client]bool
}

// take marks cl as polled by a Run; false if another Run polls it.
func (p *pollers) take(cl *kgo.Client) bool {
	p.Lock()
	defer p.Unlock()
	if p.m[cl] {
		return false
	}
	p.m[cl] = true
	return true
}

func (p *pollers) release(cl *kgo.Client) {
	p.Lock()
	defer p.Unlock()
	delete(p.m, cl)
}

func register(c *Consumer) {
	consumers.Lock()
	defer consumers.Unlock()
	for cl, ws := range consumers.m {
		live := ws[:0]
		for _, w := range ws {
			if w.Value() != nil {
				live = append(live, w)
			}
		}
		if len(live) == 0 {
			delete(consumers.m, cl)
		} else {
			consumers.m[cl] = live
		}
	}
	consumers.m[c.client] = append(consumers.m[c.client], weak.Make(c))
}

func consumersOf(cl *kgo.Client) []*Consumer {
	consumers.Lock()
	defer consumers.Unlock()
	var cs []*Consumer
	for _, w := range consumers.m[cl] {
		if c := w.Value(); c != nil {
			cs = append(cs, c)
		}
	}
	return cs
}
