package idempotency

import (
	"bytes"
	"runtime"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// panicRefl is a message whose Range panics after yielding its fields
// (those of m), with its message fields wrapped likewise when deep > 0.
type panicRefl struct {
	protoreflect.Message
	deep int
}

func (p panicRefl) Range(f func(protoreflect.FieldDescriptor, protoreflect.Value) bool) {
	p.Message.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		if fd.Message() != nil && !fd.IsList() && !fd.IsMap() && p.deep > 0 {
			v = protoreflect.ValueOfMessage(panicRefl{v.Message(), p.deep - 1})
		}
		return f(fd, v)
	})
	if p.deep == 0 {
		panic("mid-walk")
	}
}

type panicReq struct{ m protoreflect.Message }

func (p panicReq) ProtoReflect() protoreflect.Message { return panicRefl{p.m, 2} }

// Check (held): a panic mid-walk leaves no dirty walker behind, and 16
// goroutines fingerprinting a mix of requests (maps, Anys, large and
// small) through the pool get the same fingerprints as one does.
func TestAdv2FPHeldPoolAfterPanicAndConcurrency(t *testing.T) {
	md := advSchema(t, "adv2pool", "proto3", &descriptorpb.DescriptorProto{Field: []*descriptorpb.FieldDescriptorProto{
		field("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
		advMsgField("next", 2, ".adv.adv2pool.M", optional),
		field("note", 3, descriptorpb.FieldDescriptorProto_TYPE_STRING, repeated),
	}})
	var nest func(levels int, amount uint64, notes int) []byte
	nest = func(levels int, amount uint64, notes int) []byte {
		b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), amount)
		for i := range notes {
			b = protowire.AppendString(protowire.AppendTag(b, 3, protowire.BytesType), string(rune('a'+i%26)))
		}
		if levels > 0 {
			b = protowire.AppendBytes(protowire.AppendTag(b, 2, protowire.BytesType), nest(levels-1, amount+1, notes))
		}
		return b
	}
	reqs := [][]byte{nest(3, 100, 1), nest(12, 5, 3), nest(2, 7, 3000), nest(0, 1, 0)}
	want := make([][]byte, len(reqs))
	for i, r := range reqs {
		want[i] = fpOf(t, md, r)
	}
	for range 5 {
		m := dynamicpb.NewMessage(md)
		require.NoError(t, proto.Unmarshal(reqs[0], m))
		require.Panics(t, func() { _, _ = Fingerprint("/fp.Svc/Call", panicReq{m}) })
		for i, r := range reqs {
			require.Equal(t, want[i], fpOf(t, md, r), "after a panic mid-walk")
		}
	}
	var wg sync.WaitGroup
	errs := make(chan string, 16)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := range 20 {
				i := (g + n) % len(reqs)
				m := dynamicpb.NewMessage(md)
				if err := proto.Unmarshal(reqs[i], m); err != nil {
					errs <- err.Error()
					return
				}
				fp, _ := Fingerprint("/fp.Svc/Call", m)
				if !bytes.Equal(fp, want[i]) {
					errs <- "fingerprint differs under concurrency"
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Fatal(e)
	}
	runtime.GC()
}
