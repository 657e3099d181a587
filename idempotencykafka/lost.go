package idempotencykafka

import (
	"context"
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
// With kgo.BlockRebalanceOnPoll franz-go calls it only between polls, when
// no record is in flight; without it, it can come in the middle of one.
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

// newPoll forgets the partitions lost before: a poll's records are of the
// member's assignment when it polled.
func (c *Consumer) newPoll() {
	c.mu.Lock()
	clear(c.lost)
	c.mu.Unlock()
}

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
