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
	c := consumerOf(cl)
	if c == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for topic, partitions := range lost {
		for _, p := range partitions {
			if cancel := c.inFlight[topicPartition{topic, p}]; cancel != nil {
				cancel(fmt.Errorf("idempotencykafka: partition %s/%d was lost: its records are another member's", topic, p))
			}
		}
	}
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

// consumers finds the consumer of a client for OnPartitionsLost, which
// franz-go hands the client only. It holds the consumers weakly: one
// dropped with its client is forgotten at the next New.
var consumers = struct {
	sync.Mutex
	m map[*kgo.Client]weak.Pointer[Consumer]
}{m: map[*kgo.Client]weak.Pointer[Consumer]{}}

func register(c *Consumer) {
	consumers.Lock()
	defer consumers.Unlock()
	for cl, w := range consumers.m {
		if w.Value() == nil {
			delete(consumers.m, cl)
		}
	}
	consumers.m[c.client] = weak.Make(c)
}

func consumerOf(cl *kgo.Client) *Consumer {
	consumers.Lock()
	defer consumers.Unlock()
	return consumers.m[cl].Value()
}
