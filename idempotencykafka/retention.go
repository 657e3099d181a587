package idempotencykafka

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// retention is what the consumer knows of how long Kafka may deliver a
// topic's records again: the TTL each topic's IDs are kept for.
type retention struct {
	mu      sync.Mutex
	offsets time.Duration            // the brokers' offsets.retention.minutes, 0 until read
	ttl     map[string]time.Duration // by topic
}

// CheckRetention makes sure that the IDs of every topic the client
// consumes now outlast what Kafka keeps: a record is never read again
// after its ID was forgotten. Run calls it when it starts; a poll loop of
// one's own ([Consumer.ProcessFetches]) may call it before its first poll
// to fail early. Topics met later (matched by a regex, added to the
// client) are checked when their first records arrive, before any is
// applied, and by [Consumer.Message].
//
// A topic's records may come again for its retention.ms plus the brokers'
// offsets.retention.minutes (a group whose offsets expire reads its topics
// from the start). Without [WithTTL] that sum is the TTL of the topic's
// IDs; with it, a shorter TTL is refused, naming both. A topic that keeps
// its records forever (retention.ms -1, or cleanup.policy compact without
// delete) needs an explicit TTL, the operator's decision.
func (c *Consumer) CheckRetention(ctx context.Context) error {
	topics := c.client.GetConsumeTopics()
	if regex, _ := c.client.OptValue(kgo.ConsumeRegex).(bool); !regex {
		named, _ := c.client.OptValue(kgo.ConsumeTopics).([]string)
		topics = append(topics, named...)
	}
	slices.Sort(topics)
	for _, topic := range slices.Compact(topics) {
		if _, err := c.ttlOf(ctx, topic); err != nil {
			return err
		}
	}
	return nil
}

// ttlOf returns how long the IDs of topic's records are kept, reading the
// topic's and the brokers' configs the first time.
func (c *Consumer) ttlOf(ctx context.Context, topic string) (time.Duration, error) {
	c.ret.mu.Lock()
	defer c.ret.mu.Unlock()
	if ttl, ok := c.ret.ttl[topic]; ok {
		return ttl, nil
	}
	ttl, err := c.readTTL(ctx, topic)
	if err != nil {
		if !c.o.ttlSet || errors.Is(err, errRefused) {
			return 0, err
		}
		c.o.onError(fmt.Errorf("%w; going on with WithTTL(%v)", err, c.o.ttl))
		ttl = c.o.ttl
	}
	c.ret.ttl[topic] = ttl
	return ttl, nil
}

// errRefused marks a TTL the configs show to be too short.
var errRefused = errors.New("idempotencykafka: the TTL of message IDs is too short")

func (c *Consumer) readTTL(ctx context.Context, topic string) (time.Duration, error) {
	adm := kadm.NewClient(c.client)
	if c.ret.offsets == 0 {
		offsets, err := brokersOffsetsRetention(ctx, adm)
		if err != nil {
			return 0, c.retentionUnknown(err)
		}
		c.ret.offsets = offsets
	}
	rcs, err := adm.DescribeTopicConfigs(ctx, topic)
	if err == nil {
		err = firstErr(rcs)
	}
	if err != nil {
		return 0, c.retentionUnknown(err)
	}
	retention, ok := configMillis(rcs, "retention.ms", time.Millisecond)
	if !ok {
		retention = 7 * 24 * time.Hour // Kafka's default
	}
	policy := configValue(rcs, "cleanup.policy")
	forever := retention < 0 || strings.Contains(policy, "compact") && !strings.Contains(policy, "delete")
	need := retention + c.ret.offsets
	switch {
	case forever && !c.o.ttlSet:
		return 0, fmt.Errorf("%w: topic %s keeps its records forever (retention.ms %v, cleanup.policy %q): no TTL of message IDs outlasts it; "+
			"choose one with WithTTL (records read again after it are applied again)", errRefused, topic, retention, policy)
	case forever:
		return c.o.ttl, nil
	case !c.o.ttlSet:
		return need, nil
	case c.o.ttl < need:
		return 0, fmt.Errorf("%w: WithTTL(%v) is shorter than topic %s's retention.ms (%v) plus the brokers' offsets.retention.minutes (%v): "+
			"a group whose offsets expire re-reads records whose IDs are forgotten and applies them again; set at least %v",
			errRefused, c.o.ttl, topic, retention, c.ret.offsets, need)
	}
	return c.o.ttl, nil
}

// brokersOffsetsRetention reads offsets.retention.minutes from a broker's
// own configs (the cluster's default resource holds dynamic ones only).
func brokersOffsetsRetention(ctx context.Context, adm *kadm.Client) (time.Duration, error) {
	brokers, err := adm.ListBrokers(ctx)
	if err != nil {
		return 0, err
	}
	if len(brokers) == 0 {
		return 0, errors.New("no broker listed")
	}
	rcs, err := adm.DescribeBrokerConfigs(ctx, brokers[0].NodeID)
	if err == nil {
		err = firstErr(rcs)
	}
	if err != nil {
		return 0, err
	}
	if d, ok := configMillis(rcs, "offsets.retention.minutes", time.Minute); ok && d > 0 {
		return d, nil
	}
	return 7 * 24 * time.Hour, nil // Kafka's default
}

// firstErr is the first error of a resource's configs.
func firstErr(rcs kadm.ResourceConfigs) error {
	for _, rc := range rcs {
		if rc.Err != nil {
			return fmt.Errorf("%s: %w", rc.Name, rc.Err)
		}
	}
	return nil
}

// retentionUnknown is the error of a retention that cannot be read: fatal
// without an explicit TTL, since the default could then be too short.
func (c *Consumer) retentionUnknown(err error) error {
	return fmt.Errorf("idempotencykafka: the topics' retention.ms and the brokers' offsets.retention.minutes cannot be read (%w): "+
		"grant the client DescribeConfigs, or set WithTTL longer than both together", err)
}

// configValue returns a config's value, "" when absent.
func configValue(rcs kadm.ResourceConfigs, key string) string {
	for _, rc := range rcs {
		for _, cfg := range rc.Configs {
			if cfg.Key == key && cfg.Value != nil {
				return *cfg.Value
			}
		}
	}
	return ""
}

// configMillis returns a config's value as a duration of unit, -1 for a
// negative value (forever).
func configMillis(rcs kadm.ResourceConfigs, key string, unit time.Duration) (time.Duration, bool) {
	v := configValue(rcs, key)
	if v == "" {
		return 0, false
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil {
		return 0, false
	}
	if n < 0 {
		return -1, true
	}
	return time.Duration(n) * unit, true
}
