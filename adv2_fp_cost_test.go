package idempotency

import (
	"runtime"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
)

// Defect (c), minor: walker.value hashes a map's entries (in a leaf below
// maxNodeDepth, and in the whole-request hash of every cut request) with
// single() but never spill(), so the scalars of a map<int64, int64> are
// all copied into the walker's buffer, grown by doubling, before they are
// hashed: the list case fixed after the first review, for maps. A 4.8 MB
// request of 300k entries allocates about 38 MB per call (this test uses
// 100k); its keys are also sorted twice, once for the node walk though
// only a few hundred entries fit before the cut.
//
// Correct behaviour: hashing a map's entries keeps the buffer within its
// first array plus one entry (cap(buf) of at most 2 * len(small)).
func TestAdv2FPMapInALeafIsHashedInChunks(t *testing.T) { // not parallel: it reads the process's allocation count
	entry := &descriptorpb.DescriptorProto{Name: proto.String("QEntry"), Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		Field: []*descriptorpb.FieldDescriptorProto{field("key", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional),
			field("value", 2, descriptorpb.FieldDescriptorProto_TYPE_INT64, optional)}}
	md := advSchema(t, "adv2costmap", "proto3", &descriptorpb.DescriptorProto{NestedType: []*descriptorpb.DescriptorProto{entry},
		Field: []*descriptorpb.FieldDescriptorProto{advMsgField("q", 1, ".adv.adv2costmap.M.QEntry", repeated)}})
	var wire []byte
	for i := range 100000 {
		e := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), uint64(1<<40+i))
		e = protowire.AppendVarint(protowire.AppendTag(e, 2, protowire.VarintType), uint64(1<<40+i))
		wire = protowire.AppendBytes(protowire.AppendTag(wire, 1, protowire.BytesType), e)
	}
	m := dynamicpb.NewMessage(md)
	require.NoError(t, proto.Unmarshal(wire, m))
	_ = mustFP(t, m)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	fp := mustFP(t, m)
	runtime.ReadMemStats(&after)
	t.Logf("wire %d, fp %d, alloc %d mallocs %d", len(wire), len(fp), after.TotalAlloc-before.TotalAlloc, after.Mallocs-before.Mallocs)
	w := newWalker()
	fd := md.Fields().ByNumber(1)
	w.value(fd, m.Get(fd))
	require.LessOrEqual(t, cap(w.buf), 2*len(w.small), "a map's entries must be hashed as they are walked, not buffered whole")

	// The node walk sorts only the keys that can fit before the cut: the
	// entries written are still the first keys, in order.
	doc, ok := readFields(fp[fieldsHeadLen:])
	require.True(t, ok)
	require.True(t, doc.root.cut)
	items := doc.root.entries[0].items
	require.Greater(t, len(items), 100)
	for i, it := range items {
		kw := newWalker()
		kw.single(fd.MapKey(), protoreflect.ValueOfInt64(1<<40+int64(i)))
		require.Equal(t, kw.sum(nil), it.key, "entry %d: the %dth key", i, i)
	}
}
